-- mwm_slow.lua - a callback that makes each training step last about 15 ms
-- of CPU time, so tests/integration/multi_worker.sh can kill or signal a
-- worker in the middle of a run of a small model.
function slow(args)
  return {
    on_step_end = function(ctx)
      local t = os.clock()
      while os.clock() - t < ((args and args.seconds) or 0.015) do end
    end,
  }
end
