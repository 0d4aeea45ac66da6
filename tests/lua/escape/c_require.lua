-- expect: module 'lpeg' not found
-- A C module through package.cpath: the sandbox has no C searchers.
function escape(elem)
  package.cpath = "/usr/lib/x86_64-linux-gnu/liblua5.4-?.so;/usr/lib/x86_64-linux-gnu/lua/5.4/?.so;/usr/local/lib/lua/5.4/?.so"
  require("lpeg")
  return elem
end
