-- expect: memory limit of 16 MiB reached (hooks.memory_limit)
function escape(elem)
  xpcall(function() local t = {} for i = 1, 1e12 do t[i] = {i} end end, function(m) return m end)
  pcall(string.rep, "x", 1 << 30)
  return elem
end
