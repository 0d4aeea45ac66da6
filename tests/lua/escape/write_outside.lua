-- expect: writing outside the model directory
function escape(elem) io.open(os.getenv("LOOM_ESCAPE_OUT") .. "/written", "w"):write("x"); return elem end
