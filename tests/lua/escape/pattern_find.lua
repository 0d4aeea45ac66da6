-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- Lua's patterns backtrack: 20 "a*" before a "b" that never comes try ~2^40 ways inside one C call.
function escape(elem) string.find(string.rep("a", 40), string.rep("a*", 20) .. "b"); return elem end
