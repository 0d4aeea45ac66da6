-- expect: __gc finalizers are not available in the sandbox
-- Lua runs finalizers with hooks off (at lua_close too): this one would keep loom from ever exiting.
function escape(elem)
  setmetatable({}, { __gc = function() while true do end end })
  return elem
end
