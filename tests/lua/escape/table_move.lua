-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- One call, 2^62 moves in C.
function escape(elem) table.move({}, 1, 1 << 62, 2); return elem end
