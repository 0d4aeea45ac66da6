-- filters.lua - element predicates for `filter` transforms. In a config:
--   { op = "filter"; lua = "../lua/filters.lua:not_blank"; },
-- A filter function gets the element (a table of tensors) and an rng, and
-- returns true to keep the element, false to drop it.

-- Drops images with no ink at all (every pixel 0): a scanner or export glitch.
function not_blank(elem, rng)
  return elem.image:max() > 0
end
