-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- the string metatable's methods are the same functions: ("..."):match with a chain of (.-)
function escape(elem) local s = ("x"):rep(60); local a = s:match(("(.-)"):rep(12) .. "y"); return elem end
