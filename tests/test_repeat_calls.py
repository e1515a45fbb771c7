"""Issue 18 item 4: a script sent again after a timeout is safe, because every ledger script answers a
repeat of a call that already took effect with that call's first answer and does nothing else
(scripts.observed_source's journal; jobindex.JobIndex.run sends a timed-out call again with the same
journal key).

Proved per script by running the ledger's own test modules with every job script call made twice
(tests/repeat_calls.py asserts, for each call, the same answer and no change to any of the job's keys),
and checking that every job script was among them. Plus the retry itself: a call whose reply is lost
to a read timeout is sent again and answered, with nothing done twice."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gateway.ledger.scripts import OPERATIONS, PAIRS

ROOT = Path(__file__).resolve().parents[1]
#: the modules whose tests, with every job script twice, reach every job script
MODULES = ["tests/test_scripts.py", "tests/test_ledger.py", "tests/test_control.py", "tests/test_approvals.py",
           "tests/test_platform_waits.py", "tests/test_outage.py", "tests/test_max_run.py",
           "tests/test_api.py", "tests/test_lease_planning.py", "tests/test_fetch_stage.py",
           "tests/test_bisect.py", "tests/test_sinks.py"]  # compact.lua, rest.lua
#: scripts that do not run on one job's keys (a target's slots or breaker, the collation check): not
#: journaled; slot.lua and breaker.lua are idempotent by their holder id and their state (test below)
NOT_JOB_SCRIPTS = {"selfcheck", "slot", "breaker"}

pytestmark = pytest.mark.slow


def test_every_job_script_answers_a_repeat_with_its_first_answer(tmp_path):
    log = tmp_path / "operations.txt"
    env = {**os.environ, "BATCHGATE_TEST_REPEAT_SCRIPTS": str(log)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "tests.repeat_calls", "-p",
                           "no:cacheprovider", "-n", "0",
                           # counts round trips, which the repeats double
                           "-k", "not a_lease_costs_two_round_trips", *MODULES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    seen = Counter(log.read_text().split())
    expected = (set(OPERATIONS) | set(PAIRS)) - NOT_JOB_SCRIPTS
    assert expected <= set(seen), f"never run twice: {sorted(expected - set(seen))}"


def test_a_target_slot_or_breaker_call_repeated_answers_the_same_and_takes_nothing_more(ledger, redis_client):
    """slot.lua and breaker.lua run on a target's keys (no job's journal): a repeat (the same holder,
    the same failure) answers what the first call did and takes no second slot, starts no second probe
    and does not double the cooldown."""
    k = ledger.keys
    slots, breaker, waiting = k.target_slots("t1"), k.target_breaker("t1"), k.target_waiting("t1")

    def slot(holder: str) -> list:
        return ledger.scripts.slot(keys=[slots, breaker], args=[2, holder, 60_000])

    assert slot("call-a") == ["ok"] and slot("call-a") == ["ok"]
    assert redis_client.zcard(slots) == 1  # one slot for the call and its repeat
    assert slot("call-b") == ["ok"] and slot("call-c") == ["full"]

    def cool(message: str) -> list:
        return ledger.scripts.breaker(keys=[breaker, waiting], args=[message, 0, 60_000, 600_000, "job-1"])

    first = cool("503 from the platform")
    assert cool("503 from the platform") == first  # same until/since: the cooldown is not doubled
    assert redis_client.hget(breaker, "fails") == "1"
    redis_client.hset(breaker, "until_ms", 0)  # the cooldown is over: one probe may go
    redis_client.delete(slots)
    assert slot("probe-1") == ["probe"] and slot("probe-1") == ["probe"]  # the repeat is the probe
    assert slot("other")[0] == "cooldown" and redis_client.zcard(slots) == 1  # the probe goes alone
