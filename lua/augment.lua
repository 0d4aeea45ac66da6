-- augment.lua - data augmentation for 28x28 grayscale images (Fashion-MNIST),
-- written in Lua with the heavy work in Loom's C tensor ops. In a config:
--   { op = "map"; lua = "../lua/augment.lua:augment"; parallel = 2; },
-- before `batch`. Each function gets the element (a table of tensors, here
-- image uint8 (28, 28) and label uint8 ()) and an rng keyed by (run seed,
-- transform, epoch, element index), so the same seed gives the same images
-- whatever the number of threads.

-- Cutout (DeVries & Taylor, 2017): zero a size x size square centred at a
-- random pixel, clipped at the border. Works on any (H, W) or (H, W, C) image.
function cutout(elem, rng, size)
  size = size or 8
  local img = elem.image
  local cy, cx = rng:int(1, img:dim(1)), rng:int(1, img:dim(2))
  img:fill_rect(cy - size // 2, cx - size // 2, size, size, 0) -- in place (a copy of the input)
  return elem
end

-- uint8 (28, 28) -> float32 (28, 28) in [0, 1]: a random horizontal flip,
-- a random brightness shift of up to +-0.1, then cutout.
function augment(elem, rng)
  local img = elem.image:scale(1 / 255)
  if rng:bernoulli(0.5) then img = img:flip_left_right() end
  img = img:add(rng:uniform(-0.1, 0.1)):clamp(0, 1)
  return cutout({ image = img, label = elem.label }, rng, 8)
end

-- The same on a batch (after `batch`): one call per batch, so a parallel map
-- hands whole batches to its threads. image uint8 (B, 28, 28) -> float32.
function augment_batch(batch, rng)
  local out = {}
  for i = 1, batch.image:dim(1) do
    out[i] = augment({ image = batch.image:select(i) }, rng).image
  end
  return { image = loom.stack(out), label = batch.label }
end
