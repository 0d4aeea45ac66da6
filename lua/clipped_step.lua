-- clipped_step.lua - a custom training step: the built-in step plus
-- gradient clipping by global norm. In a config:
--   hooks: { train_step = { fn = "../lua/clipped_step.lua:train_step"; args = { clip_norm = 1.0; log_every = 100; }; }; };
-- Without clip_norm (or with clip_norm = 0) it does exactly what the built-in
-- step does, and the tests check that the weights come out bit-identical.
-- ctx:loss() returns one value per replica (the sum of that replica's
-- per-example losses); ctx:reduce("SUM" | "MEAN", v) combines them.
local function train_step(ctx, batch, args)
  ctx:forward(batch)
  local loss = ctx:loss()
  ctx:backward()
  ctx:all_reduce_gradients()        -- identity with one replica; SUM over replicas otherwise
  local clip = args.clip_norm or 0
  if clip > 0 then
    local norm = ctx:clip_gradients_by_norm(clip)  -- the norm before clipping, per replica
    local every = args.log_every or 0             -- log the norm every N steps (0: never)
    if every > 0 and ctx.step % every == 0 then ctx:log_scalar("grad_norm", ctx:reduce("MEAN", norm)) end
  end
  ctx:apply_gradients()
  return ctx:reduce("SUM", loss)
end

return { train_step = train_step }
