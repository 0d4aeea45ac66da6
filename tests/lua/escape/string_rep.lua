-- expect: memory limit of 16 MiB reached (hooks.memory_limit)
function escape(elem) local s = string.rep("x", 1 << 30); return elem end
