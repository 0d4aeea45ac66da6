-- expect: not a regular file
function escape(elem) io.open("/proc/self/fd/0"):read("l"); return elem end
