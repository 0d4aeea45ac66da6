-- scripted_hooks.lua - callbacks for tests/integration/hooks.sh. Line numbers
-- matter: the test checks that an error names its line.

-- Puts values[epoch] of a comma-separated list into ctx.logs.scripted at
-- each epoch end, for a callback after it (early_stopping) to read.
local function scripted(args)
  local values = {}
  for v in string.gmatch(args.values, "[^,]+") do values[#values + 1] = tonumber(v) end
  return { on_epoch_end = function(ctx) ctx.logs.scripted = values[ctx.epoch] end }
end

-- ctx:save_checkpoint() after step args.at.
local function saver(args)
  return { on_step_end = function(ctx)
    if ctx.step == args.at then print("saved " .. ctx:save_checkpoint()) end
  end }
end

-- Fails after step args.at (the error is on line 22).
local function fail_at(args)
  return { on_step_end = function(ctx)
    if ctx.step == args.at then error("scripted failure at step " .. ctx.step) end
  end }
end

-- A train step that fails at step args.at (line 29), after its update.
local function failing_step(ctx, batch, args)
  ctx:forward(); ctx:loss(); ctx:backward(); ctx:all_reduce_gradients(); ctx:apply_gradients()
  if ctx.step + 1 == args.at then error("the step failed") end
end

-- Allocates without bound after step args.at (hooks.memory_limit stops it).
local function hog(args)
  local keep = {}
  return { on_step_end = function(ctx)
    if ctx.step == args.at then while true do keep[#keep + 1] = string.rep("x", 4096) .. #keep end end
  end }
end

-- ctx:stop() at the end of every epoch from args.epoch on, keeping no state
-- (a run started again trains one more epoch unless Loom knows it stopped).
local function stop_after(args)
  return { on_epoch_end = function(ctx)
    if ctx.epoch >= args.epoch then ctx:stop() end
  end }
end

return { scripted = scripted, saver = saver, fail_at = fail_at, failing_step = failing_step, hog = hog,
         stop_after = stop_after }
