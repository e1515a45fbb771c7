-- selfcheck.lua: the digest of a fixed record, so Python can confirm Lua and Python agree
-- (Lua sorts strings with strcoll: a Redis running under a non-C collation would disagree).
-- KEYS: none   ARGV[1..] name, value pairs   Returns the digest of that record.
local map = {}
for i = 1, #ARGV, 2 do map[ARGV[i]] = ARGV[i + 1] end
return digest(map)
