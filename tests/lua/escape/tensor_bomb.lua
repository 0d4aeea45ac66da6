-- expect: memory limit of 16 MiB reached (hooks.memory_limit)
function escape(elem) local t = {} for i = 1, 1e6 do t[i] = loom.tensor("float64", {1024, 1024}) end return elem end
