-- expect: attempt to load a binary chunk (mode is 't')
function escape(elem) assert(load(string.dump(function() return 1 end), "=dump", "b")); return elem end
