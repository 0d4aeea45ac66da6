-- skip_reduce_step.lua - a custom step that forgets ctx:all_reduce_gradients()
-- in step 3 (tests/integration/mwm_lua_step.sh): under multi_worker_mirrored
-- the job must stop naming the step, never pair the next step's all-reduce
-- with the missing one.
local function train_step(ctx, batch)
  ctx:forward(batch)
  local loss = ctx:loss()
  ctx:backward()
  if ctx.step ~= 2 then
    ctx:all_reduce_gradients()
    ctx:apply_gradients()
  end
  return ctx:reduce("SUM", loss)
end

return { train_step = train_step }
