-- expect: __gc finalizers are not available in the sandbox
-- A placeholder __gc marks the table for finalization; the loop would be put in later.
function escape(elem)
  local mt = { __gc = true }
  keep = setmetatable({}, mt)
  mt.__gc = function() while true do end end
  return elem
end
