-- early_stopping.lua - stop training when a metric has stopped improving
-- (Keras's EarlyStopping). In a config:
--   hooks: { callbacks = ( { fn = "../lua/early_stopping.lua:early_stopping";
--                            args = { monitor = "eval_loss"; patience = 2; }; } ); };
-- args: monitor, a key of ctx.logs (default "eval_loss"); mode "min" or "max"
-- (default "max" for accuracy, auc, precision and recall, else "min"); patience,
-- epochs without improvement before stopping (default 0); min_delta, the
-- smallest change that counts as an improvement (default 0).
-- Its state (best value, epochs waited, stopped) is in `state`, which Loom
-- saves in checkpoints: a resumed run keeps counting, and a stopped run that
-- is started again stops at once.
local function early_stopping(args)
  local monitor = args.monitor or "eval_loss"
  -- the scores where more is better: accuracy, top_k_accuracy, auc, precision, recall
  local higher = monitor:find("accuracy") or monitor:find("auc") or monitor:find("precision") or monitor:find("recall")
  local mode = args.mode or (higher and "max" or "min")
  if mode ~= "min" and mode ~= "max" then
    error("early_stopping: mode must be \"min\" or \"max\", got \"" .. tostring(mode) .. "\"")
  end
  local patience = args.patience or 0
  local min_delta = math.abs(args.min_delta or 0)
  local cb = { state = { wait = 0, stopped = false } }

  local function improved(v, best)
    if best == nil then return true end
    if mode == "min" then return v < best - min_delta end
    return v > best + min_delta
  end

  function cb.on_train_begin(ctx)
    if cb.state.stopped then ctx:stop() end
  end

  function cb.on_epoch_end(ctx)
    local v = ctx.logs[monitor]
    if v == nil then
      error("early_stopping: ctx.logs has no \"" .. monitor .. "\" (eval_* need a data.eval section)")
    end
    local s = cb.state
    if improved(v, s.best) then
      s.best, s.best_epoch, s.wait = v, ctx.epoch, 0
      return
    end
    s.wait = s.wait + 1
    if s.wait >= patience then
      s.stopped = true
      print(string.format("early_stopping: %s has not improved on %.6g (epoch %d) for %d epoch%s; stopping after epoch %d",
                          monitor, s.best, s.best_epoch, s.wait, s.wait == 1 and "" or "s", ctx.epoch))
      ctx:stop()
    end
  end

  return cb
end

return { early_stopping = early_stopping }
