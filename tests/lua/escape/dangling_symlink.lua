-- expect: is outside the model directory
-- The test makes model/link -> out/target (dangling) before the run.
function escape(elem) io.open(os.getenv("LOOM_ESCAPE_MODEL") .. "/link", "w"):write("x"); return elem end
