-- expect: os.execute is not available in the sandbox
function escape(elem) os.execute("touch " .. os.getenv("LOOM_ESCAPE_OUT") .. "/executed"); return elem end
