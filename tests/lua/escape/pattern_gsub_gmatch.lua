-- expect: instruction limit of 10000000 reached (hooks.instruction_limit)
-- gsub with a function replacement, then gmatch, each bounded by the same budget
function escape(elem)
    local s = string.rep("ab", 30)
    s = s:gsub("(a)", function(a) return a end)
    for w in string.gmatch(s, string.rep("[ab]?", 30) .. string.rep("[ab]", 30) .. "c") do end
    return elem
end
