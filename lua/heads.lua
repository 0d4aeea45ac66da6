-- heads.lua - a second label for a two-head model (configs/fashion_mnist_two_heads.cfg):
-- "footwear" is 1 for Fashion-MNIST's sandals (5), sneakers (7) and ankle boots (9), else 0.
-- On a batch (after `batch`): label uint8 (B,) -> footwear float32 (B, 1), the label kept.
--   { op = "map"; lua = "../lua/heads.lua:footwear"; },
function footwear(batch)
  local n = batch.label:dim(1)
  local f = loom.tensor("float32", { n, 1 })
  for i = 1, n do
    local c = batch.label:get(i)
    if c == 5 or c == 7 or c == 9 then f:set(i, 1, 1) end
  end
  batch.footwear = f
  return batch
end
