"""redis_sharing: the Lua twin of ``sharing.SharedPrefixes``, part of every pool script's prelude.

The shared ledger's prefix reference counts in Redis, per pool (see ``store.redis``'s key
layout): ``pk`` holds ``<node>\\t<key>`` -> ``<holders> <tokens>`` then ``<replica> <holders>``
for each replica holding it; ``ps`` holds ``<node>\\t<b|d|e|n|x>``
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
-- A key's entry in pk is 'holders tokens' then 'replica holders' per replica that holds it.
-- ref_tokens is an entry's tokens.
local function ref_tokens(v)
  return tonumber(string.match(v, '^%S+ (%S+)'))
end
-- ref_parse is an entry's holders, tokens and {replica, holders} pairs, in order.
local function ref_parse(v)
  local w = args(v)
  local own = {}
  for j = 3, #w - 1, 2 do own[#own + 1] = {w[j], tonumber(w[j + 1])} end
  return tonumber(w[1]), tonumber(w[2]), own
end
-- ref_text writes an entry; its numbers are whole and far below 1e14, which Lua's
-- tostring writes exactly (and faster than fmt).
local function ref_text(c, t, own)
  local parts = {c, t}
  for j = 1, #own do
    parts[#parts + 1] = own[j][1]
    parts[#parts + 1] = own[j][2]
  end
  return table.concat(parts, ' ')
end
-- fields_of is node's pk fields of keys.
local function fields_of(node, keys)
  local f = {}
  for i = 1, #keys do f[i] = node .. '\t' .. keys[i] end
  return f
end
-- prefix_take is SharedPrefixes.add of the first k links {key, end} on node, asked at
-- block, for lease id (its replica's), recording the keys it took: one read and one write.
local function prefix_take(pk, ps, lk, id, node, links, k, block)
  if k == 0 then return end
  local b, d, e, n, x = ps_read(ps, node)
  if not b then b = block end
  local me = replica_of(id)
  local keys = {}
  for i = 1, k do keys[i] = links[i][1] end
  local fields = fields_of(node, keys)
  local got = redis.call('HMGET', pk, unpack(fields))
  -- cur: each field's entry as this loop left it (a key twice in a chain, a hash collision)
  local cur, order = {}, {}
  local before = 0
  for i = 1, k do
    local fin = links[i][2]
    local whole = fin - fin % b
    local t = whole - before
    if t < 0 then t = 0 end
    if whole > before then before = whole end
    local v = cur[fields[i]]
    if v == nil then
      v = got[i]
      order[#order + 1] = fields[i]
    end
    local c, tk, own = 1, t, {}
    if v then
      c, tk, own = ref_parse(v)
      c = c + 1
      d = d + tk
      if i == 1 then e = e + 1 end
    else
      n = n + 1
    end
    local mine = nil
    for j = 1, #own do if own[j][1] == me then mine = own[j] end end
    if mine then
      mine[2] = mine[2] + 1
    else
      own[#own + 1] = {me, 1}
      if #own >= 2 then x = x + tk end
    end
    cur[fields[i]] = ref_text(c, tk, own)
  end
  local writes = {}
  for i = 1, #order do
    writes[#writes + 1] = order[i]
    writes[#writes + 1] = cur[order[i]]
  end
  redis.call('HSET', pk, unpack(writes))
  ps_write(ps, node, b, d, e, n, x)
  redis.call('HSET', lk, id, table.concat(keys, ' '))
end
-- prefix_drop is SharedPrefixes.drop of the keys lease id took on node: one read, one write.
local function prefix_drop(pk, ps, lk, id, node)
  local ks = redis.call('HGET', lk, id)
  if not ks then return end
  redis.call('HDEL', lk, id)
  local b, d, e, n, x = ps_read(ps, node)
  if not b then return end
  local me = replica_of(id)
  local keys = args(ks)
  local fields = fields_of(node, keys)
  local got = redis.call('HMGET', pk, unpack(fields))
  local cur, order = {}, {}
  for i = 1, #keys do
    local v = cur[fields[i]]
    if v == nil then
      v = got[i] or false
      order[#order + 1] = fields[i]
    end
    if v then
      local c, tk, own = ref_parse(v)
      for j = 1, #own do
        if own[j][1] == me then
          own[j][2] = own[j][2] - 1
          if own[j][2] <= 0 then
            table.remove(own, j)
            if #own >= 1 then x = x - tk end
          end
          break
        end
      end
      c = c - 1
      if c <= 0 then
        cur[fields[i]] = false
        n = n - 1
      else
        d = d - tk
        if i == 1 then e = e - 1 end
        cur[fields[i]] = ref_text(c, tk, own)
      end
    end
  end
  local writes, gone = {}, {}
  for i = 1, #order do
    local v = cur[order[i]]
    if v then
      writes[#writes + 1] = order[i]
      writes[#writes + 1] = v
    elseif v == false then
      gone[#gone + 1] = order[i]
    end
  end
  if #writes > 0 then redis.call('HSET', pk, unpack(writes)) end
  if #gone > 0 then redis.call('HDEL', pk, unpack(gone)) end
  ps_write(ps, node, b, d, e, n, x)
end
-- credit is SharedPrefixes.credit and .taken of links on node asked at block, whose sums are
-- b, d, e, n: tokens charged less, and the keys a lease would take
local function credit(pk, links, node, block, b, d, e, n)
  if #links == 0 or block <= 0 or (b and b ~= block) then return 0, 0 end
  if not b then return 0, #links end
  local got = {redis.call('HGET', pk, node .. '\t' .. links[1][1])}
  if got[1] and #links > 1 then
    -- the node holds the chain's first key: read the rest at once (most nodes do not)
    local fields = {}
    for i = 1, #links do fields[i] = node .. '\t' .. links[i][1] end
    got = redis.call('HMGET', pk, unpack(fields))
  end
  local sum, run = 0, 0
  for i = 1, #got do
    if not got[i] then break end
    sum = sum + ref_tokens(got[i])
    run = i
  end
  local k = run
  if n + #links - run <= MAX_NODE_KEYS then k = #links end
  if run == 0 then return 0, k end
  return math.max(0, d + sum - b * (e + 1)) - ps_shared(b, d, e), k
end
"""
"""SHARING_LUA is the Lua of the shared prefixes (see the module doc)."""
