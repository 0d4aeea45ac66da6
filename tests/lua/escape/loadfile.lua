-- expect: loadfile is not available in the sandbox
function escape(elem) loadfile("/etc/passwd"); return elem end
