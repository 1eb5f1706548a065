"""The Lua scripts that change the shared line's state in Redis, each in one atomic step.

Redis runs a script alone: no other gateway's command interleaves with it, so "a slot is free"
and "take it" are one step, and no interleaving of gateways can hand out slot N+1 of an
upstream. Every change is also appended, in the same step, to one stream of events
(`events`), numbered without gaps (`seq`) and stamped with Redis's clock: every gateway replays
that one order into its own copy of the line (`shared.RedisSource`), so the fair order,
the positions, session affinity and each replica's health are the same everywhere.

The keys a line script gets, in this order: the stream, the counter, the line's waiters (a
hash: waiter id -> JSON of its arrival and request), the settling flag (while it exists, no
slot is granted: Redis lost its data and the gateways are still counting their running
requests again, `restore`), then one hash per upstream of the line
(slot id -> JSON of its line, grant time and request), in the order of the member names given
as JSON in ARGV[3]. A slot hash is per upstream, not per line, so an upstream's cap holds
whichever lines its slots are taken through. The number of slots taken on an upstream is the
length of its hash. Ids are `instance/boot/n`; `LEASES .. instance/boot` is the gateway's lease
key, whose expiry lets `sweep` free what a dead gateway held.
"""

from __future__ import annotations

import hashlib

PRELUDE = """
local EVENTS, SEQ, WAITING, SETTLING = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local MAXLEN, LINE = ARGV[1], ARGV[2]
local MEMBERS = cjson.decode(ARGV[3])
local LEASES = ARGV[4]
local clock = redis.call('TIME')
local NOW = clock[1] .. '.' .. string.format('%06d', tonumber(clock[2]))
local function slots_key(name)
  for i, member in ipairs(MEMBERS) do
    if member == name then return KEYS[4 + i] end
  end
end
local function emit(event, line)
  event.l = line or LINE
  event.t = NOW
  event.n = redis.call('INCR', SEQ)
  redis.call('XADD', EVENTS, 'MAXLEN', '~', MAXLEN, '*', 'e', cjson.encode(event))
end
local function idle()
  if redis.call('HLEN', WAITING) > 0 then return end
  for i = 1, #MEMBERS do
    if redis.call('HLEN', KEYS[4 + i]) > 0 then return end
  end
  emit({op = 'idle'})
end
local function take(w, info, prefs, cap)
  if redis.call('EXISTS', SETTLING) == 1 then return end
  if cap ~= '' then
    local client, held = cjson.decode(info).c, 0
    for i = 1, #MEMBERS do
      for _, raw in ipairs(redis.call('HVALS', KEYS[4 + i])) do
        local slot = cjson.decode(raw)
        if cjson.decode(slot.i).c == client then held = held + 1 end
      end
    end
    if held >= tonumber(cap) then return end
  end
  for i = 1, #prefs, 2 do
    local key = slots_key(prefs[i])
    if key and redis.call('HLEN', key) < tonumber(prefs[i + 1]) then
      redis.call('HSET', key, w, cjson.encode({l = LINE, t = NOW, i = info}))
      return prefs[i]
    end
  end
end
"""

# A request arrives: it takes a free slot if nobody waits (the first of its preferred upstreams
# with room) and its client holds fewer than its max_in_flight of the line's slots, else it
# joins the line. ARGV: w, info, arrived ('' for now), prefs (JSON array of upstream name, slot
# count, ...), the client's max_in_flight ('' for none). A client's slots are counted from the
# line's upstreams' slot hashes (whichever line took them: a reload may have moved an upstream
# to this one), a few dozen entries: no count to keep right through sweeps and restores.
JOIN = """
local w, info = ARGV[5], ARGV[6]
if redis.call('HLEN', WAITING) == 0 then
  local upstream = take(w, info, cjson.decode(ARGV[8]), ARGV[9])
  if upstream then
    emit({op = 'admit', w = w, r = upstream, i = info})
    return upstream
  end
end
local arrived = ARGV[7] ~= '' and ARGV[7] or NOW
redis.call('HSET', WAITING, w, cjson.encode({a = arrived, i = info}))
emit({op = 'join', w = w, a = arrived, i = info})
return false
"""

# A gateway claims a free slot for the waiter its copy of the line says is next. Refused (nil)
# if the waiter is gone or granted, none of the preferred upstreams has room, or its client holds
# its max_in_flight. ARGV: w, prefs, max_in_flight ('' for none).
GRANT = """
local w = ARGV[5]
local entry = redis.call('HGET', WAITING, w)
if not entry then return false end
local info = cjson.decode(entry).i
local upstream = take(w, info, cjson.decode(ARGV[6]), ARGV[7])
if not upstream then return false end
redis.call('HDEL', WAITING, w)
emit({op = 'grant', w = w, r = upstream, i = info})
return upstream
"""

# A slot is given back (once: a second release of the same slot does nothing). ARGV: w,
# upstream, '1' if it was a half-open replica's trial that ended without a verdict.
RELEASE = """
local key = slots_key(ARGV[6])
local entry = key and redis.call('HGET', key, ARGV[5])
if not entry then return 0 end
redis.call('HDEL', key, ARGV[5])
emit({op = 'release', w = ARGV[5], r = ARGV[6], x = ARGV[7]}, cjson.decode(entry).l)
idle()
return 1
"""

# A waiter gives up. 'granted' if a slot reached it first (its gateway then releases it).
LEAVE = """
local w = ARGV[5]
if redis.call('HDEL', WAITING, w) == 1 then
  emit({op = 'leave', w = w})
  idle()
  return 'left'
end
for i = 1, #MEMBERS do
  if redis.call('HEXISTS', KEYS[4 + i], w) == 1 then return 'granted' end
end
return 'unknown'
"""

# A gateway that was cut off holds a slot Redis no longer knows (Redis lost its data): it is
# counted again, over the cap if it must be, since its request is running. ARGV: w, upstream,
# granted at, info.
RESTORE = """
local key = slots_key(ARGV[6])
if not key or redis.call('HEXISTS', key, ARGV[5]) == 1 then return 0 end
redis.call('HSET', key, ARGV[5], cjson.encode({l = LINE, t = ARGV[7], i = ARGV[8]}))
emit({op = 'restore', w = ARGV[5], r = ARGV[6], g = ARGV[7], i = ARGV[8]})
return 1
"""

# An event that changes no slot: a replica's verdict or probe. ARGV: the event as JSON.
NOTE = """
emit(cjson.decode(ARGV[5]))
return 1
"""

# Free what gateways whose lease expired held: their waiters leave, their slots are released.
# ARGV[5]: a gateway's instance to free what it alone held (its clean stop), or none.
SWEEP = """
local only = ARGV[5]
local alive = {}
local function live(id)
  local owner = string.match(id, '^(.*)/[^/]*$') or id
  if alive[owner] == nil then
    if only then
      alive[owner] = owner ~= only
    else
      alive[owner] = redis.call('EXISTS', LEASES .. owner) == 1
    end
  end
  return alive[owner]
end
local swept = 0
for _, w in ipairs(redis.call('HKEYS', WAITING)) do
  if not live(w) then
    redis.call('HDEL', WAITING, w)
    emit({op = 'leave', w = w, g = '1'})
    swept = swept + 1
  end
end
for i, name in ipairs(MEMBERS) do
  local slots = redis.call('HGETALL', KEYS[4 + i])
  for j = 1, #slots, 2 do
    if not live(slots[j]) then
      redis.call('HDEL', KEYS[4 + i], slots[j])
      emit({op = 'release', w = slots[j], r = name, g = '1'}, cjson.decode(slots[j + 1]).l)
      swept = swept + 1
    end
  end
end
if swept > 0 then idle() end
return swept
"""

# Everything a gateway needs to (re)build its copies of the lines, read in one step with the
# number and stream id of the last event, so that replaying from there misses nothing.
# KEYS: the stream, the counter, then any hashes.
SNAPSHOT = """
local clock = redis.call('TIME')
local out = {redis.call('GET', KEYS[2]) or '0', '0-0',
             clock[1] .. '.' .. string.format('%06d', tonumber(clock[2]))}
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last > 0 then out[2] = last[1][1] end
for i = 3, #KEYS do out[#out + 1] = redis.call('HGETALL', KEYS[i]) end
return out
"""

# A client's tokens, for its tokens_per_day (quotas.py, core/quota.py): a list of its buckets
# "second:tokens", oldest first, by Redis's clock, and their total. KEYS: the list, the total.
# ARGV[1]: the window in seconds. Buckets that left it are dropped first, by both scripts.
TOKENS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local window = tonumber(ARGV[1])
while true do
  local first = redis.call('LINDEX', KEYS[1], 0)
  if not first then break end
  local second, tokens = string.match(first, '^(%d+):(%d+)$')
  if tonumber(second) + 1 + window > now then break end
  redis.call('LPOP', KEYS[1])
  redis.call('DECRBY', KEYS[2], tokens)
end
"""

# Tokens spent now (ARGV[2]); a second already counted (or a later one) takes them in.
SPEND = (
    TOKENS
    + """
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  local last = redis.call('LINDEX', KEYS[1], -1)
  local second, counted
  if last then second, counted = string.match(last, '^(%d+):(%d+)$') end
  if last and tonumber(second) >= tonumber(clock[1]) then
    redis.call('LSET', KEYS[1], -1, second .. ':' .. (tonumber(counted) + tokens))
  else
    redis.call('RPUSH', KEYS[1], clock[1] .. ':' .. tokens)
  end
  redis.call('INCRBY', KEYS[2], tokens)
end
for i = 1, 2 do redis.call('EXPIRE', KEYS[i], math.ceil(window) + 2) end
return 1
"""
)

# Redis's time, the total, and the oldest buckets that must leave for the total to be below
# ARGV[2] (none if it is).
SPENT = (
    TOKENS
    + """
local total, limit = tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(ARGV[2])
local leaving, left, from = {}, total, 0
while left >= limit do
  local page = redis.call('LRANGE', KEYS[1], from, from + 99)
  if #page == 0 then break end
  for _, bucket in ipairs(page) do
    leaving[#leaving + 1] = bucket
    left = left - tonumber(string.match(bucket, ':(%d+)$'))
    if left < limit then break end
  end
  from = from + 100
end
return {clock[1] .. '.' .. string.format('%06d', tonumber(clock[2])), tostring(total), leaving}
"""
)

LINE_SCRIPTS = {
    "join": JOIN,
    "grant": GRANT,
    "release": RELEASE,
    "leave": LEAVE,
    "restore": RESTORE,
    "note": NOTE,
    "sweep": SWEEP,
}
SOURCES = {name: PRELUDE + body for name, body in LINE_SCRIPTS.items()} | {
    "snapshot": SNAPSHOT,
    "spend": SPEND,
    "spent": SPENT,
}
SHAS = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in SOURCES.items()}
