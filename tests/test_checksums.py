"""Checksums kept by re-sealing (lib.lua ``reseal``): after any sequence of loads and saves in one
script, with changed fields, new fields sorting anywhere among the old ones and names that prefix each
other, the stored checksum is the digest Python computes over the stored record (records.digest), and a
record loaded twice in one script is the one saved in between."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.ledger.records import digest
from gateway.ledger.scripts import helpers

BODY = """
local rounds = cjson.decode(ARGV[1])
for _, changes in ipairs(rounds) do
  local map = load(KEYS[1])
  if not map then return {'corrupt'} end
  save(KEYS[1], map, changes)
end
local again = load(KEYS[1])
local n = 0
for _ in pairs(again) do n = n + 1 end
return {'ok', n}
"""
SCRIPT = helpers(BODY) + BODY

names = st.sampled_from(["a", "b", "st", "st:0", "st:1", "st:10", "out:0", "c:0", "z", "status", "attempt",
                         "Z", "_", "0", "a\u00e9", "st:0:x"])
values = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=8)
rounds = st.lists(st.dictionaries(names, values, min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.dictionaries(names, values, min_size=1, max_size=8), changes=rounds)
def test_a_record_resealed_after_changes_has_the_digest_of_what_is_stored(redis_client, start, changes):
    key = "t:{r}:rec"
    redis_client.delete(key)
    redis_client.hset(key, mapping={**start, "checksum": digest(start)})
    answer = redis_client.eval(SCRIPT, 1, key, json.dumps(changes))
    stored = redis_client.hgetall(key)
    assert answer[0] == "ok" and "corrupt" not in stored
    checksum = stored.pop("checksum")
    assert checksum == digest(stored)
    assert answer[1] == len(stored)  # the record loaded again (from the script's own) is what is stored


def test_a_record_damaged_before_its_load_is_refused_and_never_resealed(redis_client):
    key = "t:{r}:rec"
    redis_client.hset(key, mapping={"a": "1", "checksum": digest({"a": "1"})})
    redis_client.hset(key, "a", "2")  # damaged outside the ledger
    assert redis_client.eval(SCRIPT, 1, key, json.dumps([{"b": "x"}])) == ["corrupt"]
    assert redis_client.hget(key, "corrupt") == "1" and redis_client.hget(key, "b") is None
