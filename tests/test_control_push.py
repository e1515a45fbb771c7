"""Cancel of a push-mode job with platform calls in flight: no call starts after the cancel response and
no answer commits after it (begin.lua gates every call; cancel voids leases; late answers are logged)."""

from __future__ import annotations

import time

from tests.platforms import SlowSyncPlatform
from tests.test_push_e2e import push_stack


def test_cancel_with_calls_in_flight_starts_no_call_and_commits_nothing_after(
        settings, redis_client, tmp_path):
    platform = SlowSyncPlatform(delay=1.0)
    flow = {"id": "push-cancel", "version": "1", "batching": {"max_items": 2}, "concurrency": 4,
            "source": {"type": "sequence", "count": 40},
            "stages": [{"name": "score", "lease": 30, "timeout": 10,
                        "target": {"type": "http", "url": f"{platform.url}/score", "mode": "sync",
                                   "max_in_flight": 8}}]}
    try:
        with push_stack(settings, redis_client, tmp_path / "data", workers=1) as (api, ledger, _):
            assert api.post("/v1/flows", json=flow).status_code == 201
            job_id = api.post("/v1/jobs", json={"flow_id": "push-cancel"}).json()["job_id"]
            deadline = time.monotonic() + 30
            while len(platform.arrivals) < 4:  # four calls in flight (the flow's concurrency)
                assert time.monotonic() < deadline, "the calls did not start"
                time.sleep(0.01)
            assert api.get(f"/v1/jobs/{job_id}").json()["batches"]["leased"] == 4
            resp = api.post(f"/v1/jobs/{job_id}/cancel")
            cancelled_at = time.monotonic()
            assert resp.status_code == 200 and resp.json()["cancel"]["voided_leases"] == 4
            at_cancel = resp.json()
            time.sleep(3)  # the calls in flight answer; no new one may start
            after = api.get(f"/v1/jobs/{job_id}").json()
            log = api.get(f"/v1/jobs/{job_id}/log?limit=10000").json()["entries"]
    finally:
        platform.close()
    late_calls = [seq for t, seq in platform.arrivals if t > cancelled_at]
    assert late_calls == []
    assert len(platform.arrivals) == 4
    assert after["status"] == "cancelled"
    assert (after["items_done"], after["batches"]) == (at_cancel["items_done"], at_cancel["batches"])
    events = [e["event"] for e in log]
    cut = events.index("job_cancelled")
    assert "stage_completed" not in events[cut:]
    assert sorted(e["seq"] for e in log[cut:] if e["event"] == "late_answer") == sorted(
        seq for _, seq in platform.arrivals)
