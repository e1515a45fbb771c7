"""Every job script run twice: a pytest plugin for tests/test_repeat_calls.py.

With BATCHGATE_TEST_REPEAT_SCRIPTS set (a file path), every call of a ledger script on a job
(jobindex.JobIndex.run) is sent a second time with the same journal key, as a retry after a read
timeout would be, and the plugin asserts what scripts.observed_source promises: the repeat answers the
first answer (or raises the same error) and changes none of the job's keys. Each operation checked is
appended to the file, so the test can see that every script was."""

from __future__ import annotations

import os
import secrets
import threading

import pytest
import redis

from gateway.ledger import jobindex

LOG = os.environ.get("BATCHGATE_TEST_REPEAT_SCRIPTS")
#: one call and its repeat at a time in this process: a concurrent call between them (tests with many
#: threads) would change the job's keys under the comparison
_ONE_AT_A_TIME = threading.RLock()


def _job_keys(r, prefix: str, job_id: str) -> dict[str, bytes | None]:
    """Every key under the job's hash tag but the call journal, by its DUMP (value, not TTL)."""
    raw = r.connection_pool.connection_kwargs.get("decode_responses")
    names = sorted(k for k in r.scan_iter(match=f"{prefix}:{{{job_id}}}:*", count=1000) if ":call:" not in k)
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.execute_command("DUMP", name, **({"NEVER_DECODE": True} if raw else {}))
    return dict(zip(names, pipe.execute(), strict=True))


def _outcome(run):
    try:
        return ("answered", run())
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        raise
    except Exception as exc:  # noqa: BLE001 - compared with the repeat's, then raised again
        return ("raised", exc)


@pytest.fixture(autouse=True)
def _every_script_twice(monkeypatch):
    if not LOG:
        yield
        return
    original = jobindex.JobIndex.run

    def run(self, script, job_id, keys, args, call_id=None):
        if not hasattr(self.r, "connection_pool"):  # a RedisCluster (one test): run once, as it is
            return original(self, script, job_id, keys, args, call_id=call_id)
        call_id = call_id or secrets.token_urlsafe(12)
        operation = getattr(script, "name", "").removeprefix("ledger.")
        with _ONE_AT_A_TIME:
            first = _outcome(lambda: original(self, script, job_id, keys, args, call_id=call_id))
            before = _job_keys(self.r, self.keys.prefix, job_id)
            again = _outcome(lambda: original(self, script, job_id, keys, args, call_id=call_id))
            after = _job_keys(self.r, self.keys.prefix, job_id)
        assert type(again[1]) is type(first[1]) and str(again[1]) == str(first[1]), (
            f"{operation} answered a repeat of a call with {again[1]!r}, not its first answer {first[1]!r}")
        changed = sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))
        assert not changed, f"a repeat of {operation} changed the job's keys: {changed}"
        with open(LOG, "a") as out:
            out.write(operation + "\n")
        if first[0] == "raised":
            raise first[1]
        return first[1]

    monkeypatch.setattr(jobindex.JobIndex, "run", run)
    yield
