-- expect: module 'evil' not found
-- A module written into the model directory, then package.path widened to it.
function escape(elem)
  local dir = os.getenv("LOOM_ESCAPE_MODEL")
  local f = assert(io.open(dir .. "/evil.lua", "w")); f:write("return 'escaped'"); f:close()
  package.path = dir .. "/?.lua;" .. package.path
  require("evil")
  return elem
end
