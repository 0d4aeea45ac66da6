-- test_callbacks.lua - callback factories and train steps for tests/unit/test_hooks.c.
-- Line numbers matter: the tests check that errors name them.

-- Records what it sees; sets the learning rate at each epoch end, logs a
-- scalar, stops at args.stop_epoch, and keeps a counter in `state`.
local function recorder(args)
  local cb = { state = { epochs = 0, label = "x" }, step_interval = args.every or 1 }
  function cb.on_train_begin(ctx) cb.state.began_at = ctx.step end
  function cb.on_step_end(ctx)
    ctx:log_scalar("seen/step", ctx.step)
  end
  function cb.on_epoch_end(ctx)
    cb.state.epochs = cb.state.epochs + 1
    ctx:set_learning_rate(args.lr * ctx.epoch)
    ctx:log_scalar("eval/loss", ctx.logs.eval_loss or -1)
    local w = ctx:param("w")
    ctx:log_scalar("w2", w:get(2))
    if ctx.epoch == args.stop_epoch then ctx:stop() end
  end
  return cb
end

-- Fails in on_step_end at the line below (line 25).
local function broken(args)
  return { on_step_end = function(ctx) local t = nil; return t.field end }
end

local function misspelt(args)
  return { on_epoch_ends = function(ctx) end }
end

local function not_a_table(args)
  return 42
end

-- All the parts, in order.
local function good_step(ctx, batch, args)
  ctx:forward(batch)
  local loss = ctx:loss()
  ctx:backward()
  ctx:all_reduce_gradients()
  local norm = ctx:clip_gradients_by_norm(args.clip)
  ctx:apply_gradients()
  ctx:log_scalar("loss_sum", ctx:reduce("SUM", loss))
  ctx:log_scalar("loss_mean", ctx:reduce("MEAN", loss))
  ctx:log_scalar("norm", norm[1])
  ctx:log_scalar("reduced_number", ctx:reduce("SUM", 2.5))
end

-- ctx:loss() before ctx:forward() (line 52).
local function loss_first(ctx, batch, args)
  return ctx:loss()
end

-- Applies without all-reducing (line 58).
local function no_reduce(ctx, batch, args)
  ctx:forward(); ctx:loss(); ctx:backward()
  ctx:apply_gradients()
end

-- A state a checkpoint cannot hold.
local function bad_state(args)
  return { state = { f = function() end } }
end

local function forever(ctx, batch, args)
  while true do end
end

return { recorder = recorder, broken = broken, misspelt = misspelt, not_a_table = not_a_table,
         bad_state = bad_state, good_step = good_step, loss_first = loss_first, no_reduce = no_reduce,
         forever = forever }
