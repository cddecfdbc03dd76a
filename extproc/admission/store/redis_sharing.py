"""redis_sharing: the Lua twin of ``sharing.SharedPrefixes``, part of every pool script's prelude.

The shared ledger's prefix reference counts in Redis, per pool (see ``store.redis``'s key
layout): ``pk`` holds ``<node>\\t<key>`` -> ``<holders> <tokens> <replicas>`` and
``<node>\\t<key>\\t<replica>`` -> that replica's holders; ``ps`` holds ``<node>\\t<b|d|e|n|x>``
-> the node's block size, dup, extra, distinct keys and cross-replica tokens; ``lk`` holds a
lease id -> the keys it took, in order. ``prefix_take``, ``prefix_drop`` and ``credit`` are
``SharedPrefixes.add``, ``.drop`` and ``.credit``/``.taken`` line for line; the differential
test (``tests/unit/admission/test_shared_prefix.py``) holds them equal. The fragment uses
the prelude's ``args``, ``fmt`` and ``replica_of`` and the constant ``MAX_NODE_KEYS``.
"""

SHARING_LUA = r"""
-- ps_read is a node's sums in ps: block (nil: no key held), dup, extra, keys, cross.
local function ps_read(ps, node)
  local v = redis.call('HMGET', ps, node .. '\tb', node .. '\td', node .. '\te', node .. '\tn', node .. '\tx')
  return tonumber(v[1]), tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0, tonumber(v[5]) or 0
end
-- ps_shared is Prefixes.shared of a node's sums.
local function ps_shared(b, d, e)
  if not b then return 0 end
  return math.max(0, d - b * e)
end
local function ps_write(ps, node, b, d, e, n, x)
  if n <= 0 then
    redis.call('HDEL', ps, node .. '\tb', node .. '\td', node .. '\te', node .. '\tn', node .. '\tx')
  else
    redis.call('HSET', ps, node .. '\tb', fmt(b), node .. '\td', fmt(d), node .. '\te', fmt(e),
      node .. '\tn', fmt(n), node .. '\tx', fmt(x))
  end
end
local function ref_read(v)
  local w = args(v)
  return tonumber(w[1]), tonumber(w[2]), tonumber(w[3])
end
-- prefix_take is SharedPrefixes.add of the first k links {key, end} on node, asked at
-- block, for lease id (its replica's), recording the keys it took.
local function prefix_take(pk, ps, lk, id, node, links, k, block)
  if k == 0 then return end
  local b, d, e, n, x = ps_read(ps, node)
  if not b then b = block end
  local me = replica_of(id)
  local before, keys = 0, {}
  for i = 1, k do
    local key, fin = links[i][1], links[i][2]
    local whole = fin - fin % b
    local t = whole - before
    if t < 0 then t = 0 end
    if whole > before then before = whole end
    local f = node .. '\t' .. key
    local v = redis.call('HGET', pk, f)
    local c, tk, nr = 1, t, 0
    if v then
      c, tk, nr = ref_read(v)
      c = c + 1
      d = d + tk
      if i == 1 then e = e + 1 end
    else
      n = n + 1
    end
    if redis.call('HINCRBY', pk, f .. '\t' .. me, 1) == 1 then
      nr = nr + 1
      if nr >= 2 then x = x + tk end
    end
    redis.call('HSET', pk, f, fmt(c) .. ' ' .. fmt(tk) .. ' ' .. fmt(nr))
    keys[i] = key
  end
  ps_write(ps, node, b, d, e, n, x)
  redis.call('HSET', lk, id, table.concat(keys, ' '))
end
-- prefix_drop is SharedPrefixes.drop of the keys lease id took on node.
local function prefix_drop(pk, ps, lk, id, node)
  local ks = redis.call('HGET', lk, id)
  if not ks then return end
  redis.call('HDEL', lk, id)
  local b, d, e, n, x = ps_read(ps, node)
  if not b then return end
  local me = replica_of(id)
  local i = 0
  for key in string.gmatch(ks, '%S+') do
    i = i + 1
    local f = node .. '\t' .. key
    local v = redis.call('HGET', pk, f)
    if v then
      local c, tk, nr = ref_read(v)
      local mine = redis.call('HINCRBY', pk, f .. '\t' .. me, -1)
      if mine <= 0 then
        redis.call('HDEL', pk, f .. '\t' .. me)
        nr = nr - 1
        if nr >= 1 then x = x - tk end
      end
      c = c - 1
      if c <= 0 then
        redis.call('HDEL', pk, f)
        n = n - 1
      else
        d = d - tk
        if i == 1 then e = e - 1 end
        redis.call('HSET', pk, f, fmt(c) .. ' ' .. fmt(tk) .. ' ' .. fmt(nr))
      end
    end
  end
  ps_write(ps, node, b, d, e, n, x)
end
-- credit is SharedPrefixes.credit and .taken of links on node asked at block, whose sums are
-- b, d, e, n: tokens charged less, and the keys a lease would take
local function credit(pk, links, node, block, b, d, e, n)
  if #links == 0 or block <= 0 or (b and b ~= block) then return 0, 0 end
  if not b then return 0, #links end
  local fields = {}
  for i = 1, #links do fields[i] = node .. '\t' .. links[i][1] end
  local got = redis.call('HMGET', pk, unpack(fields))
  local sum, run = 0, 0
  for i = 1, #links do
    if not got[i] then break end
    local _, tk = ref_read(got[i])
    sum = sum + tk
    run = i
  end
  local k = run
  if n + #links - run <= MAX_NODE_KEYS then k = #links end
  if run == 0 then return 0, k end
  return math.max(0, d + sum - b * (e + 1)) - ps_shared(b, d, e), k
end
"""
"""SHARING_LUA is the Lua of the shared prefixes (see the module doc)."""
