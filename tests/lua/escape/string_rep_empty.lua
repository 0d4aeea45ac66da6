-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- 2^62 copies of "" allocate nothing but loop 2^62 times in C, where the count hook never runs.
function escape(elem) local s = string.rep("", 1 << 62); return elem end
