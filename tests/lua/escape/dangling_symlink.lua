-- expect: writing outside the model directory
-- todo: the model-directory check resolves only the parent of a path that does not exist, so a dangling symlink in the model directory is followed out of it; fixed by the path check in core (another branch)
-- The test makes model/link -> out/target (dangling) before the run.
function escape(elem) io.open(os.getenv("LOOM_ESCAPE_MODEL") .. "/link", "w"):write("x"); return elem end
