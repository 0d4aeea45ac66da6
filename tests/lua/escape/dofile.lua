-- expect: dofile is not available in the sandbox
function escape(elem) dofile("/etc/passwd"); return elem end
