"""Flow migration (issue 16, item 3): a paused or failed job moves to another version of its flow.

The stand-in platform on 127.0.0.1 counts the runs it is paid for per Idempotency-Key, so "committed
batches are not re-run" is counted where the money is, not read from batchgate's own records. The
dispatcher that runs the calls is built before the migration, in its own Ledger, so it holds the old
spec in its cache: it must notice the migration by itself (Ledger.spec, spec_gen).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

import gateway.push.dispatch
from gateway.errors import Conflict
from gateway.ledger.flows import parse_flow
from gateway.ledger.ledger import Ledger
from gateway.ledger.migrate import migrate
from gateway.push.dispatch import Dispatcher
from tests.conftest import drain
from tests.platforms import FakePlatform, Recorded, Reply, contract, envelope_items

RETRY = {"initial_interval": 0.5, "maximum_interval": 0.5, "maximum_attempts": 50}


class PaidPlatform(FakePlatform):
    """Three workflows: ``/score`` and ``/store-fixed`` succeed; ``/store-broken`` stores its first call
    and then answers a retryable flow failure ("Error in workflow") for ever. ``paid`` counts runs per
    path and Idempotency-Key."""

    def __init__(self) -> None:
        super().__init__()
        self.paid: dict[str, Counter] = {"/score": Counter(), "/store-broken": Counter(),
                                         "/store-fixed": Counter()}

    def route(self, req: Recorded, reply: Reply) -> None:
        if req.path not in self.paid:
            return reply.text(404, "Not Found")
        with self._lock:
            self.paid[req.path][req.headers.get("Idempotency-Key")] += 1
            broken = req.path == "/store-broken" and sum(self.paid[req.path].values()) > 1
        if broken:
            return reply.json(200, {"status": "failed", "error": {"message": "Error in workflow",
                                                                  "retryable": True}})
        return reply.json(200, contract(envelope_items(req.json)))


def flow(platform: PaidPlatform, version: str, store: str, extra: list | None = None) -> dict:
    def stage(name: str, path: str) -> dict:
        return {"name": name, "idempotent": True, "timeout": 5, "lease": 10, "retry": RETRY,
                "target": {"type": "http", "url": f"{platform.base_url}{path}", "mode": "sync"}}
    return {"id": "screen", "version": version, "batching": {"max_items": 2}, "concurrency": 1,
            "source": {"type": "sequence", "count": 6},
            "stages": [stage("score", "/score"), stage("store", store), *(extra or [])]}


@pytest.fixture
def push(settings, redis_client, monkeypatch):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
    ledger = Ledger(redis_client, own)
    d = Dispatcher.build(own, ledger)
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)
    return ledger, d


@pytest.fixture
def platform():
    with PaidPlatform() as p:
        yield p


def start(api, registry, platform, versions: dict[str, dict]) -> str:
    for body in versions.values():
        registry.register("acme", parse_flow(body))
    resp = api.post("/v1/jobs", json={"flow_id": "screen", "flow_version": "1"})
    assert resp.status_code == 201, resp.text
    return resp.json()["job_id"]


def test_pause_migrate_to_a_fixed_target_resume_runs_nothing_committed_again(push, registry, api, platform):
    ledger, d = push
    job_id = start(api, registry, platform, {"1": flow(platform, "1", "/store-broken"),
                                             "2": flow(platform, "2", "/store-fixed")})
    d.run_ready(job_id)  # batch 0 commits both stages; 1 and 2 commit score, their store keeps failing
    assert ledger.job_fields(job_id)["n_done"] == "1"
    assert api.post(f"/v1/jobs/{job_id}/pause").status_code == 200

    resp = api.post(f"/v1/jobs/{job_id}/migrate", json={"flow_version": "2", "reason": "store fixed"})
    assert resp.status_code == 200, resp.text
    view = resp.json()
    old_hash = view["flow"]["previous"]["hash"]
    assert view["flow"]["version"] == "2" and view["flow"]["previous"]["version"] == "1"
    assert view["flow"]["hash"] == registry.get("acme", "screen", "2")["hash"] != old_hash
    audit = api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]
    moved = [e for e in audit if e["event"] == "flow_migrated"]
    assert [(e["actor"], e["reason"], e["from_hash"], e["to_hash"]) for e in moved] == [
        ("tenant:acme", "store fixed", old_hash, view["flow"]["hash"])]

    assert api.post(f"/v1/jobs/{job_id}/resume").status_code == 200
    deadline = time.monotonic() + 20
    while ledger.job_fields(job_id)["status"] == "running":  # d still holds version 1 in its cache
        assert time.monotonic() < deadline, ledger.job_fields(job_id)
        d.run_ready(job_id)
        time.sleep(0.05)

    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    score, broken, fixed = (platform.paid[p] for p in ("/score", "/store-broken", "/store-fixed"))
    assert len(score) == 3 and set(score.values()) == {1}  # no committed score ran again
    stored_before = [key for key, n in broken.items() if n == 1 and key not in fixed]
    assert len(stored_before) == 1  # batch 0, stored by version 1, not paid again
    assert len(fixed) == 2 and set(fixed.values()) == {1}
    assert set(fixed) <= set(broken)  # the same idempotency keys across versions


def test_a_version_that_drops_or_renames_a_stage_in_use_is_refused_naming_it(
        push, registry, api, platform):
    ledger, d = push
    renamed = flow(platform, "3", "/store-fixed")
    renamed["stages"][1]["name"] = "save"
    appended = flow(platform, "4", "/store-fixed", extra=[{"name": "notify"}])
    longer = flow(platform, "5", "/store-fixed", extra=[{"name": "notify", "lease": 120}])
    job_id = start(api, registry, platform, {"1": flow(platform, "1", "/store-broken"), "3": renamed,
                                             "4": appended, "5": longer})
    body = {"flow_version": "3", "reason": "rename"}
    resp = api.post(f"/v1/jobs/{job_id}/migrate", json=body)
    assert resp.status_code == 409 and "running" in resp.json()["detail"]  # pause first
    d.run_ready(job_id)
    api.post(f"/v1/jobs/{job_id}/pause")
    resp = api.post(f"/v1/jobs/{job_id}/migrate", json=body)
    assert resp.status_code == 409 and resp.json()["incompatible"] == ["store"]
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    assert api.get(f"/v1/jobs/{job_id}").json()["flow"]["version"] == "1"  # nothing changed
    for bad in ({"flow_version": "9", "reason": "x"}, {"flow_version": "4"}, {"flow_version": "a:b",
                                                                                "reason": "x"}):
        assert api.post(f"/v1/jobs/{job_id}/migrate", json=bad).status_code in (404, 422)
    resp = api.post(f"/v1/jobs/{job_id}/migrate", json={"flow_version": "4", "reason": "add notify"})
    assert resp.status_code == 200 and resp.json()["stages"] == ["score", "store", "notify"]
    ledger.set_status(job_id, "failed", ("paused",), "test", "gave up")  # a failed job moves too
    resp = api.post(f"/v1/jobs/{job_id}/migrate", json={"flow_version": "1", "reason": "back"})
    assert resp.status_code == 409 and resp.json()["incompatible"] == ["notify"]  # batch 0 completed
    resp = api.post(f"/v1/jobs/{job_id}/migrate", json={"flow_version": "5", "reason": "longer lease"})
    assert resp.status_code == 200 and resp.json()["flow"]["previous"]["version"] == "4"


def test_a_migration_racing_a_batch_commit_never_leaves_a_half_migrated_job(
        push, registry, jobs, redis_client, settings):
    """Another process (its own Ledger and spec cache) commits leased batches while migrations run: a
    migration either finds nothing leased and moves the whole job (spec, spec_gen, audit entry) or
    changes nothing. Had it moved the job under a lease, that process would commit the batch with the
    old version's stage count and the appended stage would never run for it."""
    ledger, _ = push
    other = Ledger(redis_client, settings)
    v1 = parse_flow({"id": "race", "version": "1", "batching": {"max_items": 1}, "concurrency": 8,
                     "source": {"type": "sequence", "count": 200},
                     "stages": [{"name": "score"}, {"name": "store"}]})
    v2 = parse_flow({**v1.model_dump(mode="json"), "version": "2",
                     "stages": [{"name": "score"}, {"name": "store"}, {"name": "notify"}]})
    v3 = parse_flow({**v2.model_dump(mode="json"), "version": "3",
                     "stages": [{"name": "score"}, {"name": "store"}, {"name": "notify", "lease": 120}]})
    for version in (v1, v2, v3):
        registry.register("acme", version)
    nxt = {"1": v2, "2": v3, "3": v2}  # 1 -> 2 appends a stage; then 2 <-> 3 (a new lease length)
    from gateway.ledger.jobs import JobRequest, ResumeRequest
    job_id = jobs.create("acme", JobRequest(flow_id="race", flow_version="1"))["job_id"]
    k = ledger.keys.job(job_id)
    outcomes: Counter = Counter()
    for lease in [other.lease(job_id) for _ in range(8)]:  # the next leases are at v1's last stage
        other.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})
    for round_ in range(12):
        leases = [lease for _ in range(8) if (lease := other.lease(job_id)) is not None]
        ledger.pause(job_id, "test")
        if round_ == 0:  # leases out, no commit yet: always refused
            with pytest.raises(Conflict) as refused:
                migrate(ledger, ledger.spec(job_id), v2, registry.get("acme", "race", "2")["hash"], "t", "")
            assert refused.value.extra["leased"] == len(leases) == 8
        go = threading.Barrier(2)

        def commit_all():
            go.wait()
            for lease in leases:
                other.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})

        t = threading.Thread(target=commit_all)
        t.start()
        go.wait()
        if round_ == 11:  # the last round migrates after the commits: at least one migration
            t.join()
        spec = ledger.spec(job_id)
        target = nxt[spec.flow.version]
        try:
            migrate(ledger, spec, target, registry.get("acme", "race", target.version)["hash"], "test",
                    f"round {round_}")
            outcomes["migrated"] += 1
        except Conflict as exc:  # the other allowed outcome: batches were still leased
            assert exc.extra.get("leased"), exc
            outcomes["refused"] += 1
        t.join()
        job, stored = ledger.job_fields(job_id), ledger.spec(job_id)
        migrated = [e for _, e in ledger.r.xrange(k.audit) if e["event"] == "flow_migrated"]
        assert int(job.get("spec_gen") or 0) == stored.spec_gen == len(migrated) == outcomes["migrated"]
        assert "corrupt" not in job
        jobs.resume("acme", job_id, ResumeRequest(), "test")  # waits out the settle after a migration
    drain(other, job_id, output=lambda lease: {"ok": 1})
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    batches = [ledger.batch_record(job_id, s) for s in range(int(ledger.job_fields(job_id)["next_seq"]))]
    assert all(b["status"] == "completed" for b in batches)
    done_on_v1 = set()  # batches whose last v1 stage committed before the first migration (log order)
    for _, entry in ledger.r.xrange(k.log):
        if entry["event"] == "flow_migrated":
            break
        if entry["event"] == "stage_completed" and entry["stage"] == "1":
            done_on_v1.add(int(entry["seq"]))
    skipped = [int(b["seq"]) for b in batches
               if int(b["seq"]) not in done_on_v1 and b.get("st:2") != "completed"]
    assert len(done_on_v1) < len(batches) and skipped == []
    assert outcomes["migrated"] >= 1 and sum(outcomes.values()) == 12, outcomes  # every batch not done before the first migration ran the appended stage


def test_cli_migrates_a_paused_job_and_reports_a_refusal(api, registry, monkeypatch, capsys):
    from gateway.runtime.cli import main
    from tests.conftest import TOKEN

    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)
    base = {"id": "cli", "batching": {"max_items": 5}, "source": {"type": "sequence", "count": 10}}
    registry.register("acme", parse_flow({**base, "version": "1", "stages": [{"name": "score"}]}))
    registry.register("acme", parse_flow({**base, "version": "2",
                                          "stages": [{"name": "score", "lease": 120}]}))
    job_id = api.post("/v1/jobs", json={"flow_id": "cli", "flow_version": "1"}).json()["job_id"]
    argv = ["jobs", "migrate", "--url", api.base, job_id, "--flow-version", "2", "--reason", "longer lease"]
    assert main(argv) == 1 and "409" in capsys.readouterr().err  # running: pause first
    api.post(f"/v1/jobs/{job_id}/pause")
    assert main(argv) == 0 and '"spec_gen": 1' in capsys.readouterr().out
    assert api.get(f"/v1/jobs/{job_id}").json()["flow"]["version"] == "2"
