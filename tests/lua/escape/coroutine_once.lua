-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
function escape(elem)
  coroutine.resume(coroutine.create(function() while true do end end))
  return elem
end
