-- expect: memory limit of 16 MiB reached (hooks.memory_limit)
function escape(elem) local t = {} for i = 1, 1e12 do t[i] = {i} end return elem end
