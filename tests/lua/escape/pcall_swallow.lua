-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
function escape(elem)
  while true do pcall(function() while true do end end) end
end
