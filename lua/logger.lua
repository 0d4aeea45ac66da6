-- logger.lua - custom scalars in <model_dir>/metrics.jsonl, as
-- {"event": "scalar", "step": ..., "epoch": ..., "name": ..., "value": ...} lines:
-- the running train loss and the learning rate every `every` steps, and at
-- each epoch end the L2 norm of one parameter (read with ctx:param). In a config:
--   hooks: { callbacks = ( { fn = "../lua/logger.lua:logger"; args = { every = 100; param = "dense_1/kernel"; }; } ); };
-- args: every (default 100); param, a parameter name (default: the first;
-- ctx:param_names() lists them).
local function logger(args)
  local cb = { step_interval = args.every or 100 }
  local param = args.param

  function cb.on_train_begin(ctx)
    param = param or ctx:param_names()[1]
    ctx:param(param) -- fails now, with the names the model has, rather than at the first epoch end
  end

  function cb.on_step_end(ctx)
    if ctx.logs.loss then ctx:log_scalar("train/loss", ctx.logs.loss) end
    ctx:log_scalar("train/learning_rate", ctx.logs.learning_rate)
  end

  function cb.on_epoch_end(ctx)
    local w = ctx:param(param)
    local sum = 0.0
    for i = 1, w:numel() do
      local x = w:get(i)
      sum = sum + x * x
    end
    ctx:log_scalar("param_norm/" .. param, math.sqrt(sum))
    if ctx.logs.eval_accuracy then ctx:log_scalar("eval/accuracy", ctx.logs.eval_accuracy) end
  end

  return cb
end

return { logger = logger }
