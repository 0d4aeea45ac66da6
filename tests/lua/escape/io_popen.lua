-- expect: io.popen is not available in the sandbox
function escape(elem) io.popen("touch " .. os.getenv("LOOM_ESCAPE_OUT") .. "/popened"); return elem end
