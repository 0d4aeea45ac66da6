-- expect: memory limit of 16 MiB reached (hooks.memory_limit)
function escape(elem) local s = string.rep(string.rep("x", 4096), 1 << 16); return elem end
