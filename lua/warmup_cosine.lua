-- warmup_cosine.lua - a learning rate that rises linearly to `peak` over
-- `warmup_steps`, then decays along a cosine to alpha * peak at `total_steps`
-- and stays there. In a config:
--   hooks: { callbacks = ( { fn = "../lua/warmup_cosine.lua:warmup_cosine";
--            args = { peak = 0.1; warmup_steps = 200; total_steps = 4690; alpha = 0.0; }; } ); };
-- lr(step) = peak * (step + 1) / warmup_steps             while step < warmup_steps
--          = peak * ((1 - alpha) * 0.5 * (1 + cos(pi * t / d)) + alpha)   after,
--            with d = total_steps - warmup_steps, t = min(step - warmup_steps, d).
-- With warmup_steps = 0 this is exactly the built-in `cosine` schedule (same
-- operations in double precision), which the tests use to check that
-- ctx:set_learning_rate takes effect. It sets the rate of the next update at
-- the start of the run (also a resumed one: the rate is a function of the
-- step, so nothing needs saving) and after every step.
local function warmup_cosine(args)
  local peak = assert(args.peak, "warmup_cosine: args.peak (the largest learning rate) is required")
  local warmup = args.warmup_steps or 0
  local total = assert(args.total_steps, "warmup_cosine: args.total_steps is required")
  local alpha = args.alpha or 0.0
  if warmup < 0 or total <= warmup then
    error("warmup_cosine: need 0 <= warmup_steps < total_steps")
  end

  local function lr(step)
    if step < warmup then return peak * (step + 1) / warmup end
    local d = total - warmup
    local t = math.min(step - warmup, d)
    local cosd = 0.5 * (1.0 + math.cos(math.pi * t / d))
    return peak * ((1.0 - alpha) * cosd + alpha)
  end

  -- The rate of the next update. A rate must be > 0, and with alpha = 0 the
  -- curve reaches 0 at total_steps: a run that ends there never needs it; one
  -- that goes on is told so rather than trained at a rate off the curve.
  local function set(ctx)
    local r = lr(ctx.step)
    if r > 0 then return ctx:set_learning_rate(r) end
    if ctx.step > total then
      error(string.format("warmup_cosine: step %d is past total_steps = %d, where the rate is 0 (alpha = 0); "
                          .. "set total_steps to the run's length, or alpha > 0", ctx.step, total))
    end
  end

  local cb = { step_interval = 1 }
  cb.on_train_begin = set
  cb.on_step_end = set
  return cb
end

return { warmup_cosine = warmup_cosine }
