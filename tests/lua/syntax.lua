function broken(elem, rng)
  return elem +
end
