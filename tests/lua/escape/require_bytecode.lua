-- expect: attempt to load a binary chunk (mode is 't')
-- bc.lua, next to this file when the test runs it, holds a precompiled chunk (altered bytecode crashes liblua).
function escape(elem) require("bc"); return elem end
