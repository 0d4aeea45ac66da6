-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- Each insert at the front shifts the whole table in C: few VM instructions, much work.
function escape(elem)
  local t = {} for i = 1, 1e5 do t[i] = i end
  while true do table.insert(t, 1, 0); table.remove(t, 1) end
end
