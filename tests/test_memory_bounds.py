"""Per-process structures stay bounded: the spec cache is an LRU and forgets retired jobs; job
listing pages through a tenant's index and drops the ids of jobs whose retention ran out; a batch's bound
(max_bytes, else max_items x max_record_bytes) stays within BATCHGATE_MAX_BATCH_BYTES (422 otherwise,
before any read), and a plan reads ahead no more than that.

tests/test_soak.py checks the same end to end, by the processes' memory over 20,000 jobs.
"""

from __future__ import annotations

import json
import sys
import threading

import pytest

from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from gateway.push.supervisor import Supervisor
from tests.conftest import drain


def test_spec_cache_keeps_the_most_recently_used_specs_only(redis_client, make_job, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGATE_SPEC_CACHE", "3")  # how an operator bounds it
    ledger = Ledger(redis_client, Settings(redis_url="redis://unused", data_dir=tmp_path / "d"))
    ids = [make_job(items=2) for _ in range(6)]
    for job_id in ids:
        ledger.spec(job_id)
    ledger.spec(ids[3])  # used again: now the most recent
    assert list(ledger._specs) == [ids[4], ids[5], ids[3]]
    assert ledger.spec(ids[0]).job_id == ids[0]  # read again from Redis, evicting ids[4]
    assert list(ledger._specs) == [ids[5], ids[3], ids[0]]


def test_spec_cache_survives_threads_racing_over_a_small_cache(ledger, make_job, monkeypatch):
    monkeypatch.setattr(ledger, "spec_cache", 2)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps of a cache lookup
    ids = [make_job(items=2) for _ in range(5)]
    errors = []

    def hammer(offset: int) -> None:
        try:
            for i in range(300):
                assert ledger.spec(ids[(i + offset) % len(ids)]).job_id == ids[(i + offset) % len(ids)]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == [] and len(ledger._specs) <= 2


def test_supervisor_forgets_the_spec_of_a_job_it_retires(ledger, make_job):
    job_id = make_job(items=4, max_items=2, stages=("only",))
    drain(ledger, job_id)
    assert job_id in ledger._specs
    Supervisor(ledger, name="sup").tick()
    assert not ledger.r.sismember(ledger.keys.active, job_id)
    assert job_id not in ledger._specs


# -- batches are bounded in memory (issue 15: one job creation took a worker from 65 MB to 712 MB) ----------

MIB = 1024 * 1024


def write_mib_lines(path, n: int) -> str:
    """``n`` jsonl lines of just under 1 MiB each (the default max_record_bytes)."""
    line = json.dumps({"blob": "x" * (MIB - 100)}) + "\n"
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(line)
    return str(path)


def test_a_flow_whose_batch_could_outgrow_the_limit_needs_max_bytes(api, tmp_path):
    """100,000 items x 1 MiB: refused with a 422 naming the fix, before the creation probe reads a byte."""
    from tests.test_file_sources_security import peak_rss_growth_mib

    flow = {"id": "big", "version": "1", "stages": [{"name": "s"}], "batching": {"max_items": 100_000}}
    path = write_mib_lines(tmp_path / "big.jsonl", 48)
    refused = api.post("/v1/flows", json={**flow, "source": {"type": "jsonl", "path": path}})
    assert refused.status_code == 422 and "batching.max_bytes" in refused.json()["detail"], refused.text
    assert api.post("/v1/flows", json=flow).status_code == 201  # no source yet: checked at creation
    resp, grew = peak_rss_growth_mib(
        lambda: api.post("/v1/jobs", json={"flow_id": "big", "source": {"type": "jsonl", "path": path}}))
    assert resp.status_code == 422, resp.text
    problem = resp.json()
    assert problem["field"] == "batching.max_bytes" and "BATCHGATE_MAX_BATCH_BYTES" in problem["detail"]
    assert grew < 16, f"RSS rose {grew:.1f} MiB refusing the job"
    assert api.get("/v1/jobs").json() == {"jobs": []}


def test_with_max_bytes_the_creation_probe_holds_about_max_bytes(api, tmp_path):
    from tests.test_file_sources_security import peak_rss_growth_mib

    path = write_mib_lines(tmp_path / "big.jsonl", 48)
    flow = {"id": "big", "version": "1", "stages": [{"name": "s"}],
            "batching": {"max_items": 100_000, "max_bytes": 2 * MIB},
            "source": {"type": "jsonl", "path": path}}
    assert api.post("/v1/flows", json=flow).status_code == 201
    resp, grew = peak_rss_growth_mib(lambda: api.post("/v1/jobs", json={"flow_id": "big"}))
    assert resp.status_code == 201, resp.text
    assert grew < 24, f"RSS rose {grew:.1f} MiB for a 2 MiB first batch"


def test_max_bytes_over_the_limit_is_422(serve_small_limit):
    flow = {"id": "f", "version": "1", "stages": [{"name": "s"}], "batching": {"max_bytes": 4 * MIB}}
    resp = serve_small_limit.post("/v1/flows", json=flow)
    assert resp.status_code == 422 and "max_bytes is 4194304" in resp.json()["detail"], resp.text


@pytest.fixture
def serve_small_limit(settings, redis_client):
    from gateway.api.app import create_app
    from tests.conftest import TOKEN
    from tests.http import ApiClient, serve_app

    base, stop = serve_app(create_app(settings.model_copy(update={"max_batch_bytes": 2 * MIB}), redis_client))
    yield ApiClient(base, TOKEN)
    stop()


def test_a_plan_reads_ahead_no_more_than_max_batch_bytes(ledger, registry, jobs, settings, tmp_path):
    """Planning ahead cuts up to 16 batches of a local file; they are held together until stored."""
    from gateway.ledger.flows import parse_flow
    from gateway.ledger.jobs import JobRequest
    from gateway.ledger.planner import cut_batches

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"i": i, "pad": "p" * 10_000}) + "\n" for i in range(400)))
    flow = parse_flow({"id": "rows", "version": "1", "stages": [{"name": "s"}],
                       "batching": {"max_items": 10}, "source": {"type": "jsonl", "path": str(path)}})
    registry.register("acme", flow)
    job_id = jobs.create("acme", JobRequest(flow_id="rows"))["job_id"]
    spec = ledger.spec(job_id)
    tight = settings.model_copy(update={"max_batch_bytes": 250_000})  # about 2.5 batches of ~100 kB
    cut = cut_batches(spec, {"type": "offset", "offset": 0}, 16, None, tight)
    assert len(cut) == 3 and sum(len(b[2]) for b in cut) < 250_000 + 110_000
    assert len(cut_batches(spec, {"type": "offset", "offset": 0}, 16, None, settings)) == 16


def test_a_job_spec_stores_its_flow_without_defaults_and_reads_back_whole(ledger, make_job, settings):
    """The spec keeps the flow without its default values (a fraction of the bytes, per job), reads
    back equal to the registered flow, and a spec stored whole (by an older batchgate) reads the same."""
    from gateway.ledger.records import dumps, seal

    stage_defs = [{"name": "score", "on_fatal": "bisect", "retry": {"maximum_attempts": 5}},
                  {"name": "review", "approval": {"timeout": 60, "on_timeout": "approve"}},
                  {"name": "store", "lease": 120}]
    job_id = make_job(items=10, stage_defs=stage_defs, budget={"tokens": 1000}, tolerated_failure_percentage=5)
    k = ledger.keys.job(job_id)
    stored = ledger.r.hget(k.spec, "flow")
    fresh = Ledger(ledger.r, settings)  # no cached spec: read from Redis
    flow = fresh.spec(job_id).flow
    whole = dumps(flow.model_dump(mode="json"))
    assert len(stored) * 2 < len(whole)
    assert json.loads(stored)["stages"][1]["approval"] == {"timeout": "PT1M", "on_timeout": "approve"}
    assert flow.stages[0].retry.maximum_attempts == 5 and flow.stages[2].lease.total_seconds() == 120
    assert flow.budget.tokens == 1000 and flow.tolerated_failure_percentage == 5
    fields = {name: value for name, value in ledger.r.hgetall(k.spec).items() if name != "checksum"}
    ledger.r.hset(k.spec, mapping=seal({**fields, "flow": whole}))  # as written before
    assert Ledger(ledger.r, settings).spec(job_id).flow == flow
