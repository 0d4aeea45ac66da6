-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- The limit hit inside a coroutine must end the whole call, not just the coroutine.
function escape(elem)
  while true do coroutine.resume(coroutine.create(function() while true do end end)) end
end
