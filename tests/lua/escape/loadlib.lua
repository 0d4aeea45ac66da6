-- expect: package.loadlib is not available in the sandbox
function escape(elem) package.loadlib("libc.so.6", "system")("true"); return elem end
