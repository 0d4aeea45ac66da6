-- expect: attempt to index a nil value (global 'debug')
function escape(elem) debug.sethook(); return elem end
