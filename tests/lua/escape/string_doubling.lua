-- expect: memory limit of 16 MiB reached (hooks.memory_limit)
function escape(elem) local s = "x" for i = 1, 64 do s = s .. s end return elem end
