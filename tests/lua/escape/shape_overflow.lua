-- expect: shape (4611686018427387905, 4) is too large
-- A shape whose element count overflows int64 wrapped to 4 elements, and
-- t:set(k, 1, v) then wrote past a 4-byte buffer.
function escape(elem)
  local t = loom.tensor("uint8", {(1 << 62) + 1, 4}, 0)
  t:set(1 << 40, 1, 255)
  return elem
end
