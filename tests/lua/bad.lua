-- bad.lua - map functions that go wrong on purpose, for tests/integration/lua.sh.
-- Each expects an element with "index" (from an enumerate transform), "image"
-- uint8 (28, 28) and "label"; on the probe call (all zeros) they behave.

function fail_at_10000(elem, rng)
  if elem.index:get(1) == 9999 then error("cannot augment element " .. elem.index:get(1)) end
  return { image = elem.image:scale(1 / 255), label = elem.label }
end

function spin(elem, rng)
  local n = 0
  while elem.index:get(1) == 5 do n = n + 1 end
  return { image = elem.image:scale(1 / 255), label = elem.label }
end

function hog(elem, rng)
  local kept = {}
  while elem.index:get(1) == 5 do kept[#kept + 1] = elem.image:scale(1) end
  return { image = elem.image:scale(1 / 255), label = elem.label }
end

function shell(elem, rng)
  if elem.index:get(1) == 5 then os.execute("touch /tmp/loom_lua_escape") end
  return { image = elem.image:scale(1 / 255), label = elem.label }
end
