"""Result sinks and compaction (docs/design.md "Result sinks and compaction"): committed outputs leave
Redis for a file or an HTTP endpoint, exactly once in a file, at least once with stable ids over HTTP,
and delivered batch records below the watermark fold into range summaries that every reader serves."""

from __future__ import annotations

import csv
import dataclasses
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from gateway.errors import InvalidRequest
from gateway.ledger import archive
from gateway.ledger.embedded import EmbeddedRedis, client_for
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest, JobService, ResumeRequest
from gateway.ledger.ledger import Ledger
from gateway.ledger.results import compact_keys
from gateway.push.sinks import SinkDeliverer
from gateway.settings import Settings
from tests.conftest import TOKEN, drain
from tests.test_cli import cli

__all__ = ["cli"]  # the fixture, shared with test_cli.py

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def settings(redis_server, tmp_path):
    (tmp_path / "out").mkdir()
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"},
                    sink_roots={"*": [str(tmp_path / "out")]}, outbound_allow=["127.0.0.1"],
                    sink_chunk=4, sink_timeout=0.5, sink_grace=0)


def new_job(jobs, registry, sink, items=30, max_items=3, stages=("score", "store"), name="f1"):
    flow = parse_flow({"id": name, "version": "1", "stages": [{"name": s} for s in stages],
                       "batching": {"max_items": max_items}, "concurrency": 100,
                       "source": {"type": "sequence", "count": items}})
    registry.register("acme", flow)
    return jobs.create("acme", JobRequest(flow_id=name, sink=sink))["job_id"]


def output(lease):
    return {"stage": lease.stage, "first": lease.items[0]}


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def job_memory(r, job_id: str) -> dict[str, int]:
    """MEMORY USAGE of the job's keys but its call journal (scripts.JOURNAL_MS: 120 s each)."""
    return {key.split("}:", 1)[1]: r.memory_usage(key, samples=0) for key in r.scan_iter(f"*{{{job_id}}}*")
            if ":call:" not in key}


def test_jsonl_sink_gets_every_batch_once_and_records_compact(ledger, jobs, registry, tmp_path):
    path = tmp_path / "out" / "results.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)})
    drain(ledger, job_id, output)
    deliverer = SinkDeliverer(ledger)
    assert deliverer.run_once() == 10
    got = lines(path)
    assert [r["seq"] for r in got] == list(range(10))
    assert len({r["id"] for r in got}) == 10
    assert got[3]["outputs"] == {"score": {"stage": "score", "first": 9},
                                 "store": {"stage": "store", "first": 9}}
    assert got[3]["cursor"] == {"type": "offset", "offset": 9} and got[3]["items"] == 3
    k = ledger.keys.job(job_id)
    assert not any(ledger.r.exists(k.batch(s)) for s in range(10))  # compacted
    [summary] = [json.loads(v) for f, v in ledger.r.hgetall(k.sink).items() if f.startswith("r:")]
    assert summary | {} == {"first": 0, "last": 9, "gen": "0", "cursor": {"type": "offset", "offset": 0},
                            "end_cursor": None, "batches": 10, "items": 30, "superseded": 0}
    view = jobs.view("acme", job_id)
    assert view["status"] == "succeeded" and view["items_done"] == 30
    assert view["sink"] | {} == {"type": "jsonl", "delivered_below_seq": 10, "batches_delivered": 10,
                                 "items_delivered": 30, "behind": 0, "amendments_owed": 0,
                                 "amendments_delivered": 0, "error": None, "error_ms": None}
    # readers serve the summary: the listing (a row per range, pageable by seq), one batch, by status
    [row] = jobs.batches("acme", job_id, None, -1, 100)
    assert (row["first_seq"], row["last_seq"], row["status"], row["items"]) == (0, 9, "completed", 30)
    assert jobs.batches("acme", job_id, None, row["seq"], 100) == []
    assert jobs.batches("acme", job_id, "failed", -1, 100) == []
    one = jobs.batch("acme", job_id, 4)
    assert one["status"] == "completed" and one["compacted"] and one["range"]["first_seq"] == 0
    # at rest, the job left Redis apart from its own records
    assert ledger.r.sismember(ledger.keys.sink_jobs, job_id) == 0
    assert deliverer.run_once() == 0 and len(lines(path)) == 10


def test_nothing_above_the_watermark_is_delivered_or_compacted(ledger, jobs, registry, tmp_path):
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=12, stages=("only",))
    leases = [ledger.lease(job_id) for _ in range(4)]
    for lease in leases[1:3]:
        ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    deliverer = SinkDeliverer(ledger)
    assert deliverer.run_once() == 0
    assert not path.exists() or path.read_text() == ""
    k = ledger.keys.job(job_id)
    assert all(ledger.r.exists(k.batch(s)) for s in range(4))
    ledger.complete(job_id, 0, leases[0].lease_token, output(leases[0]))
    assert deliverer.run_once() == 3
    assert [r["seq"] for r in lines(path)] == [0, 1, 2]
    assert ledger.r.exists(k.batch(3))  # still leased: open, kept
    listed = jobs.batches("acme", job_id, None, -1, 100)
    assert [(r.get("first_seq"), r["seq"], r["status"]) for r in listed] == [(0, 2, "completed"),
                                                                              (None, 3, "leased")]


def test_compact_script_refuses_what_is_not_delivered_and_answers_repeats(ledger, jobs, registry, tmp_path):
    job_id = new_job(jobs, registry, {"type": "discard"}, items=12, stages=("only",))
    k = ledger.keys.job(job_id)
    lease = ledger.lease(job_id)
    compact = ledger.scripts.compact
    assert compact(keys=compact_keys(k, 0, 1), args=[0, 0, 1, 0, 1]) == ["above_watermark", "0"]
    ledger.complete(job_id, lease.seq, lease.lease_token, {})
    assert compact(keys=compact_keys(k, 0, 1), args=[5, 0, 6, 0, 1]) == ["raced", "0", "0"]
    assert compact(keys=compact_keys(k, 0, 1), args=[0, 0, 1, 0, 1]) == ["ok", "1", "0"]
    assert compact(keys=compact_keys(k, 0, 1), args=[0, 0, 1, 0, 1]) == ["duplicate", "1", "0"]
    assert [f for f in ledger.r.hkeys(k.sink) if f.startswith("r:")] == ["r:0"]


def test_csv_sink_writes_a_header_and_a_row_per_batch(ledger, jobs, registry, tmp_path):
    path = tmp_path / "out" / "r.csv"
    job_id = new_job(jobs, registry, {"type": "csv", "path": str(path)}, items=10)
    drain(ledger, job_id, output)
    SinkDeliverer(ledger).run_once()
    rows = list(csv.DictReader(path.open()))
    assert [int(r["seq"]) for r in rows] == [0, 1, 2, 3]
    assert json.loads(rows[1]["store"]) == {"stage": "store", "first": 3}
    assert rows[1]["id"] == f"{job_id}.1"


def test_file_sink_paths_are_confined_to_the_sink_roots(jobs, registry, tmp_path):
    for bad in ({"type": "jsonl", "path": str(tmp_path / "elsewhere.jsonl")},
                {"type": "jsonl", "path": str(tmp_path / "out" / ".." / "x.jsonl")},
                {"type": "jsonl", "path": "relative.jsonl"},
                {"type": "jsonl", "path": str(tmp_path / "data" / "x.jsonl")},
                {"type": "jsonl"}, {"type": "s3", "path": "/x"},
                {"type": "http", "url": "http://10.0.0.1/x"}):
        with pytest.raises(InvalidRequest):
            new_job(jobs, registry, bad, name=f"f{abs(hash(str(bad)))}")


def test_a_crash_between_write_and_record_never_duplicates_a_line(ledger, jobs, registry, tmp_path):
    """Lines written past the recorded offset (the process died before compact.lua ran) are cut off and
    written again by the next delivery: the final file holds each batch once."""
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)})
    drain(ledger, job_id, output)
    deliverer = SinkDeliverer(ledger)
    deliverer._deliver_chunk(ledger.spec(job_id))  # seqs 0-3 recorded
    with path.open("a") as fh:  # what a killed delivery leaves: seqs 4.. written, half a line last
        fh.write(json.dumps({"id": f"{job_id}.4", "seq": 4}) + "\n" + '{"id": "half')
    deliverer.run_once()
    assert [r["seq"] for r in lines(path)] == list(range(10))


def _http_sink(behaviour):
    """A sink endpoint on a free loopback port: behaviour(n, body) -> status (0 = hang past the
    client's timeout after taking the records). Yields (url, received records in arrival order)."""
    received: list[dict] = []
    calls = [0]

    @Request.application
    def app(request):
        calls[0] += 1
        body = json.loads(request.get_data())
        status = behaviour(calls[0], body)
        if status in (0, 200):
            received.extend(body["records"])
        if status == 0:
            time.sleep(1.5)
            status = 200
        return Response("{}", status=status, content_type="application/json")

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.server_port}/sink", received, server.shutdown


def test_http_sink_refused_hung_and_repeated_delivers_every_batch_with_stable_ids(ledger, jobs, registry):
    # 1st call refused (503), 2nd taken but never answered in time (the client times out, so the same
    # chunk goes again: the receiver sees it twice), the rest answered
    url, received, stop = _http_sink(lambda n, body: {1: 503, 2: 0}.get(n, 200))
    try:
        job_id = new_job(jobs, registry, {"type": "http", "url": url})
        drain(ledger, job_id, output)
        deliverer = SinkDeliverer(ledger)
        deadline = time.monotonic() + 20
        while jobs.view("acme", job_id)["sink"]["delivered_below_seq"] < 10 and time.monotonic() < deadline:
            deliverer._retry_at.clear()  # no backoff wait in the test
            deliverer.run_once()
        ids = [r["id"] for r in received]
        assert sorted(set(ids)) == sorted(f"{job_id}.{s}" for s in range(10))  # every batch
        assert len(ids) > len(set(ids))  # some twice: the receiver dedupes by id
        by_id = {r["id"]: r for r in received}
        assert by_id[f"{job_id}.7"]["outputs"]["store"] == {"stage": "store", "first": 21}
        assert jobs.view("acme", job_id)["sink"]["error"] is None
    finally:
        stop()


def test_a_failing_sink_keeps_records_and_shows_the_error(ledger, jobs, registry):
    url, received, stop = _http_sink(lambda n, body: 500)
    try:
        job_id = new_job(jobs, registry, {"type": "http", "url": url}, items=9)
        drain(ledger, job_id, output)
        SinkDeliverer(ledger).run_once()
        view = jobs.view("acme", job_id)
        assert view["sink"]["delivered_below_seq"] == 0 and "500" in view["sink"]["error"]
        k = ledger.keys.job(job_id)
        assert all(ledger.r.exists(k.batch(s)) for s in range(3))  # nothing undelivered compacts
        assert jobs.batch("acme", job_id, 1)["stages"]["store"]["output"] == {"stage": "store", "first": 3}
    finally:
        stop()


def test_rewind_ranges_split_by_generation_and_superseded_batches_are_not_delivered(ledger, jobs, registry,
                                                                                       tmp_path):
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=12, stages=("only",))
    first = ledger.lease(job_id)
    ledger.complete(job_id, first.seq, first.lease_token, output(first))
    ledger.lease(job_id)  # seq 1 leased, then superseded by the rewind
    ledger.replan(job_id, {"type": "offset", "offset": 0}, "op", "again")
    drain(ledger, job_id, output)
    SinkDeliverer(ledger).run_once()
    got = lines(path)
    assert [r["cursor"]["offset"] for r in got] == [0, 0, 3, 6, 9]
    assert [r["generation"] for r in got] == [0, 1, 1, 1, 1]
    rows = jobs.batches("acme", job_id, None, -1, 100)
    # the first plan cut seqs 0-3 (read ahead): 0 committed, 1-3 superseded by the rewind
    assert [(r["first_seq"], r["last_seq"], r["generation"]) for r in rows] == [(0, 3, 0), (4, 7, 1)]
    assert (rows[0]["batches_completed"], rows[0]["batches_superseded"]) == (1, 3)
    assert jobs.batches("acme", job_id, "superseded", -1, 100)[0]["first_seq"] == 0


KILLED_DELIVERY = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from gateway.ledger.embedded import client_for
    from gateway.ledger.ledger import Ledger
    from gateway.push import sinks
    from gateway.settings import Settings

    settings = Settings.model_validate_json({settings!r})
    ledger = Ledger(client_for(settings.redis_url.get_secret_value()), settings)
    real_write = os.write
    calls = [0]

    def write(fd, data):
        calls[0] += 1
        if calls[0] == {kill_at}:  # half of this chunk on disk, nothing recorded: killed mid-delivery
            real_write(fd, bytes(data)[:len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(fd, data)

    sinks.os.write = write
    sinks.SinkDeliverer(ledger).run_once()
""")


@pytest.mark.parametrize("kill_at", [1, 2])
def test_sigkill_mid_delivery_then_restart_delivers_each_batch_once(ledger, jobs, registry, tmp_path,
                                                                     settings, kill_at):
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)})
    drain(ledger, job_id, output)
    dumped = settings.model_dump(mode="json") | {"redis_url": settings.redis_url.get_secret_value()}
    script = KILLED_DELIVERY.format(root=str(ROOT), settings=json.dumps(dumped), kill_at=kill_at)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert ledger.r.get(ledger.keys.job(job_id).sink_claim)  # the dead deliverer's claim, left behind
    ledger.r.delete(ledger.keys.job(job_id).sink_claim)  # (it expires in CLAIM_MS; not waited for here)
    k = ledger.keys.job(job_id)
    delivered = int(ledger.r.hget(k.sink, "seq") or 0)
    assert all(ledger.r.exists(k.batch(s)) for s in range(delivered, 10))  # nothing undelivered lost
    SinkDeliverer(ledger).run_once()
    assert [r["seq"] for r in lines(path)] == list(range(10))


def test_redis_restart_mid_job_loses_no_delivery_and_duplicates_none(tmp_path):
    (tmp_path / "out").mkdir()
    server = EmbeddedRedis(tmp_path / "redis", fsync="always")
    url = server.start()
    try:
        settings = Settings(redis_url=url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"},
                            sink_roots={"*": [str(tmp_path / "out")]}, sink_chunk=3, sink_grace=0)
        ledger = Ledger(client_for(url), settings)
        from gateway.ledger.flows import FlowRegistry

        jobs = JobService(ledger, FlowRegistry(ledger.r, ledger.keys))
        path = tmp_path / "out" / "r.jsonl"
        job_id = new_job(jobs, jobs.flows, {"type": "jsonl", "path": str(path)}, items=30)
        for _ in range(8):  # some batches committed (both stages), then delivered
            lease = ledger.lease(job_id)
            ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
        SinkDeliverer(ledger).run_once()
        server.stop()
        server = EmbeddedRedis(tmp_path / "redis", fsync="always")
        url = server.start()
        ledger = Ledger(client_for(url), settings.model_copy(update={"redis_url": url}))
        jobs = JobService(ledger, FlowRegistry(ledger.r, ledger.keys))
        drain(ledger, job_id, output)
        SinkDeliverer(ledger).run_once()
        assert [r["seq"] for r in lines(path)] == list(range(10))
        assert jobs.view("acme", job_id)["sink"]["batches_delivered"] == 10
    finally:
        server.stop()


def test_a_job_at_rest_holds_no_batch_record(ledger, jobs, registry, tmp_path):
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=300)
    drain(ledger, job_id, output)
    SinkDeliverer(ledger).run_once()
    memory = job_memory(ledger.r, job_id)
    # its spec and streams folded into one value (archive.py); what is left: job, sink, cost, past
    assert sorted(memory) == ["cost", "job", "past", "sink"], memory
    k = ledger.keys.job(job_id)
    log = archive.entries(ledger.r, k, "log")
    assert len(log) == 100 and log[-1][1]["seq"] == "99"  # log_at_rest, the newest
    assert [f["event"] for _, f in archive.entries(ledger.r, k, "audit")] == ["job_created"]
    assert jobs.view("acme", job_id)["flow"]["id"] == "f1"  # the spec, from the past
    # 2.4 KB: the log's 100 entries, compressed with the rest, take ~0.9 KB of the past (a one-batch
    # job at rest: 1.6 KB, benchmarks/bench_memory.py); the streams alone took 8-12 KB before
    assert sum(memory.values()) < 2_800, memory


def test_a_fresh_commit_waits_out_the_grace_and_a_late_repeat_is_stale(ledger, jobs, registry, tmp_path,
                                                                       settings):
    """A batch goes to the sink ``sink_grace`` after its commit: until then a repeated answer finds its
    record and gets its first answer; once compacted, an answer for it is a 409 stale lease."""
    from gateway.errors import StaleLease

    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=6, stages=("only",))
    lease = ledger.lease(job_id)
    first = ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    patient = Ledger(ledger.r, settings.model_copy(update={"sink_grace": timedelta(seconds=60)}))
    assert SinkDeliverer(patient).run_once() == 0  # within the grace: kept
    again = ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    assert again == {**first, "duplicate": True}
    assert SinkDeliverer(ledger).run_once() == 1  # no grace
    with pytest.raises(StaleLease) as err:
        ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    assert err.value.extra["batch_status"] == "compacted"


def test_flow_sink_over_the_api_job_override_and_the_cli_listing(api, ledger, cli, tmp_path):
    flow = {"id": "sunk", "version": "1", "batching": {"max_items": 2}, "stages": [{"name": "s"}],
            "source": {"type": "sequence", "count": 8},
            "sink": {"type": "jsonl", "path": str(tmp_path / "out" / "flow.jsonl")}}
    refused = api.post("/v1/flows", json=flow)  # every job of the flow would write that one file
    assert refused.status_code == 422 and "{job_id}" in str(refused.json())
    flow["sink"]["path"] = str(tmp_path / "out" / "flow-{job_id}.jsonl")
    assert api.post("/v1/flows", json=flow).status_code == 201
    bad = api.post("/v1/jobs", json={"flow_id": "sunk", "sink": {"type": "jsonl", "path": "/etc/x.jsonl"}})
    assert bad.status_code == 422 and "sink" in bad.json()["detail"]
    job_id = api.post("/v1/jobs", json={"flow_id": "sunk"}).json()["job_id"]
    flow_path = tmp_path / "out" / f"flow-{job_id}.jsonl"
    assert flow_path.exists()  # made at creation: a second job naming it is refused
    taken = api.post("/v1/jobs", json={"flow_id": "sunk", "sink": {"type": "jsonl", "path": str(flow_path)}})
    assert taken.status_code == 422 and "exists" in taken.json()["detail"]
    other = api.post("/v1/jobs", json={"flow_id": "sunk", "sink": {"type": "csv", "path": str(
        tmp_path / "out" / "own.csv")}}).json()["job_id"]
    for job in (job_id, other):
        while (r := api.post(f"/v1/jobs/{job}/lease")).status_code == 200:
            api.post(f"/v1/jobs/{job}/batches/{r.json()['seq']}/complete",
                     json={"lease_token": r.json()["lease_token"], "output": {"seq": r.json()["seq"]}})
    SinkDeliverer(ledger).run_once()
    assert [r["outputs"]["s"] for r in lines(flow_path)] == [{"seq": s} for s in range(4)]
    assert len((tmp_path / "out" / "own.csv").read_text().splitlines()) == 5  # header + 4
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["sink"]["batches_delivered"] == 4 and view["status"] == "succeeded"
    rows = api.get(f"/v1/jobs/{job_id}/batches").json()
    rows = rows["batches"] if isinstance(rows, dict) else rows
    assert [(r["first_seq"], r["last_seq"], r["compacted"]) for r in rows] == [(0, 3, True)]
    one = api.get(f"/v1/jobs/{job_id}/batches/2").json()
    assert one["compacted"] and one["status"] == "completed"
    code, out, _ = cli("jobs", "batches", job_id)
    assert code == 0 and "#0-3" in out and "delivered to the sink" in out


def test_the_supervisor_delivers_while_it_runs(ledger, jobs, registry, tmp_path, settings):
    """`batchgate supervisor` runs the deliverer in a thread beside its passes."""
    from gateway.push.supervisor import Supervisor

    path = tmp_path / "out" / "r.jsonl"
    fast = Ledger(ledger.r, settings.model_copy(update={"supervisor_interval": timedelta(seconds=0.05)}))
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=9)
    drain(ledger, job_id, output)
    sup = Supervisor(fast, name="sup-sinks")
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not path.exists() or len(path.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
    finally:
        sup.stop.set()
        thread.join(10)
    assert [r["seq"] for r in lines(path)] == [0, 1, 2]
    assert not thread.is_alive()


KILLED_AFTER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from gateway.ledger.embedded import client_for
    from gateway.ledger.ledger import Ledger
    from gateway.push import sinks
    from gateway.settings import Settings

    settings = Settings.model_validate_json({settings!r})
    ledger = Ledger(client_for(settings.redis_url.get_secret_value()), settings)
    real = getattr(sinks.SinkDeliverer, {method!r})
    calls = [0]

    def wrapped(self, *args):
        real(self, *args)
        calls[0] += 1
        if calls[0] == {kill_on}:  # the sink took this call's records; killed before the cursor moved
            os.kill(os.getpid(), signal.SIGKILL)

    setattr(sinks.SinkDeliverer, {method!r}, wrapped)
    sinks.SinkDeliverer(ledger).run_once()
""")



def test_sigkill_after_an_http_post_resends_the_chunk_with_the_same_ids(ledger, jobs, registry, settings):
    url, received, stop = _http_sink(lambda n, body: 200)
    try:
        job_id = new_job(jobs, registry, {"type": "http", "url": url})
        drain(ledger, job_id, output)
        dumped = settings.model_dump(mode="json") | {"redis_url": settings.redis_url.get_secret_value()}
        script = KILLED_AFTER.format(root=str(ROOT), settings=json.dumps(dumped), method="_post",
                                     kill_on=2)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        assert jobs.view("acme", job_id)["sink"]["delivered_below_seq"] == 4  # the first chunk only
        ledger.r.delete(ledger.keys.job(job_id).sink_claim)
        SinkDeliverer(ledger).run_once()
        ids = [r["id"] for r in received]
        assert sorted(set(ids)) == sorted(f"{job_id}.{s}" for s in range(10))
        assert [i for i in ids if ids.count(i) > 1] == [f"{job_id}.{s}" for s in (4, 5, 6, 7)] * 2
        assert jobs.view("acme", job_id)["sink"]["delivered_below_seq"] == 10
    finally:
        stop()


def test_the_console_job_and_batch_pages_show_compacted_ranges(settings, redis_client, ledger, jobs, registry,
                                                               tmp_path):
    import requests

    from gateway.api.app import create_app
    from tests.http import serve_app

    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=12, stages=("only",))
    leases = [ledger.lease(job_id) for _ in range(4)]
    for lease in leases[:3]:
        ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    SinkDeliverer(ledger).run_once()  # seqs 0-2 compacted, 3 leased
    base, stop = serve_app(create_app(settings, redis_client))
    try:
        http = requests.Session()
        assert http.post(f"{base}/console/sign-in", data={"token": TOKEN}, timeout=10).status_code == 200
        page = http.get(f"{base}/console/jobs/{job_id}", timeout=10)
        assert page.status_code == 200 and "0&ndash;2" in page.text and "delivered to the sink" in page.text
        assert f"/console/jobs/{job_id}/batches/3" in page.text
        sink = page.text[page.text.index('id="sink"'):]
        assert "Result sink" in sink and "3 batches (9 items) delivered, every batch below\n    3" in sink
        one = http.get(f"{base}/console/jobs/{job_id}/batches/1", timeout=10)
        assert one.status_code == 200 and "completed" in one.text
    finally:
        stop()


def test_rest_script_shrinks_a_job_at_rest_and_loses_no_audit_or_event(ledger, jobs, registry):
    job_id = new_job(jobs, registry, {"type": "discard"}, items=30)
    k = ledger.keys.job(job_id)
    args = {"keys": [k.job, k.log, k.audit, k.events, k.sink], "args": [5]}
    assert ledger.scripts.rest(**args) == ["live", "running"]
    drain(ledger, job_id, output)
    ledger.r.pexpire(k.audit, 3_600_000)  # retention's TTL, kept
    before = {key: (ledger.r.xrange(key), ledger.r.memory_usage(key, samples=0))
              for key in (k.audit, k.events)}
    assert ledger.scripts.rest(**args) == ["ok"]
    for key, (entries, size) in before.items():
        assert ledger.r.xrange(key) == entries  # the same entries, ids included
        assert ledger.r.memory_usage(key, samples=0) < size / 3  # 4.7 KB -> under 1 KB
    assert ledger.r.xlen(k.log) == 5
    assert 3_500_000 < ledger.r.pttl(k.audit) <= 3_600_000
    assert ledger.r.pttl(k.events) == -1
    assert ledger.scripts.rest(**args) == ["ok"]  # again: the same
    assert ledger.r.xlen(k.log) == 5


def test_a_rewind_after_compaction_runs_again_from_a_delivered_cursor(ledger, jobs, registry, tmp_path):
    """Resume by cursor on a job whose records are summaries: the cursor comes from the sink's record
    (a compacted batch's own cursors left Redis with it); the range runs again under new seqs and the
    sink gets it as generation 1, after generation 0."""
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=12, stages=("only",))
    drain(ledger, job_id, output)
    SinkDeliverer(ledger).run_once()
    cursor = lines(path)[2]["cursor"]  # batch 2's start, as the sink has it
    jobs.resume("acme", job_id, ResumeRequest(cursor=cursor, reason="redo from batch 2"), "op")
    drain(ledger, job_id, output)
    SinkDeliverer(ledger).run_once()
    got = lines(path)
    assert [(r["seq"], r["generation"], r["cursor"]["offset"]) for r in got] == [
        (0, 0, 0), (1, 0, 3), (2, 0, 6), (3, 0, 9), (4, 1, 6), (5, 1, 9)]
    rows = jobs.batches("acme", job_id, None, -1, 100)
    assert [(r["first_seq"], r["last_seq"], r["generation"]) for r in rows] == [(0, 3, 0), (4, 5, 1)]
    assert jobs.view("acme", job_id)["status"] == "succeeded"


def test_a_failed_batch_holds_delivery_until_retry_failed_then_all_arrive_in_order(ledger, jobs, registry,
                                                                                   tmp_path):
    path = tmp_path / "out" / "r.jsonl"
    flow = parse_flow({"id": "tolerant", "version": "1", "tolerated_failure_percentage": 50,
                       "stages": [{"name": "only", "retry": {"maximum_attempts": 1}}],
                       "batching": {"max_items": 3}, "concurrency": 100,
                       "source": {"type": "sequence", "count": 12}})
    registry.register("acme", flow)
    job_id = jobs.create("acme", JobRequest(flow_id="tolerant", sink={"type": "jsonl", "path": str(path)}))[
        "job_id"]
    while (lease := ledger.lease(job_id)) is not None:
        if lease.seq == 1:
            ledger.fail(job_id, lease.seq, lease.lease_token, "boom", retryable=False)
        else:
            ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    assert jobs.view("acme", job_id)["status"] == "succeeded"  # within its budget
    deliverer = SinkDeliverer(ledger)
    deliverer.run_once()
    assert [r["seq"] for r in lines(path)] == [0]  # batch 1 holds the watermark
    view = jobs.view("acme", job_id)
    assert view["sink"]["behind"] == 0 and view["committed_seq"] == 0
    assert jobs.batch("acme", job_id, 3)["stages"]["only"]["output"] == {"stage": "only", "first": 9}  # kept
    assert ledger.reopen(job_id, "op", only_failed=True) == 1
    drain(ledger, job_id, output)
    deliverer.run_once()
    assert [r["seq"] for r in lines(path)] == [0, 1, 2, 3]
    assert not any(ledger.r.exists(ledger.keys.job(job_id).batch(s)) for s in range(4))


@pytest.mark.slow
def test_delivery_and_compaction_on_a_redis_cluster(cluster_client, cluster_settings, tmp_path):
    """compact.lua and rest.lua on a Redis Cluster (3 masters, 3 replicas: tests/cluster.py), the
    deliverer's pipelines across slots, several jobs."""
    from gateway.ledger.flows import FlowRegistry

    (tmp_path / "out").mkdir()
    settings = cluster_settings.model_copy(update={"sink_roots": {"*": [str(tmp_path / "out")]},
                                                   "sink_grace": timedelta(0), "sink_chunk": 4})
    ledger = Ledger(cluster_client, settings)
    jobs = JobService(ledger, FlowRegistry(cluster_client, ledger.keys))
    made = [new_job(jobs, jobs.flows, {"type": "jsonl", "path": str(tmp_path / "out" / "{job_id}.jsonl")},
                    name=f"c{i}") for i in range(3)]
    for job_id in made:
        drain(ledger, job_id, output)
    assert SinkDeliverer(ledger).run_once() == 30
    for job_id in made:
        assert [r["seq"] for r in lines(tmp_path / "out" / f"{job_id}.jsonl")] == list(range(10))
        [row] = jobs.batches("acme", job_id, None, -1, 10)
        assert (row["first_seq"], row["last_seq"], row["items"]) == (0, 9, 30)
        k = ledger.keys.job(job_id)  # at rest: folded into its past on the job's slot (archive.lua)
        assert cluster_client.exists(k.past) and not cluster_client.exists(k.spec)
        assert 0 < len(archive.entries(cluster_client, k, "log")) <= settings.log_at_rest
        assert jobs.view("acme", job_id)["status"] == "succeeded"
    assert cluster_client.scard(ledger.keys.sink_jobs) == 0


def test_a_batch_with_quarantined_items_is_delivered_but_keeps_its_record_for_the_retry(ledger, jobs, registry,
                                                                                       tmp_path):
    """Bisection and sinks: the batch that set a poison item apart is delivered with its good items'
    outputs like any other, but compaction leaves its record (and items) in place, so the quarantine
    listing and a retry of the item still work after delivery, and retention expires it with the job."""
    from tests.test_bisect import run

    path = tmp_path / "out" / "bisected.jsonl"
    flow = parse_flow({"id": "bis", "version": "1", "batching": {"max_items": 4}, "concurrency": 100,
                       "tolerated_failure_percentage": 50, "source": {"type": "sequence", "count": 12},
                       "stages": [{"name": "score", "on_fatal": "bisect"}, {"name": "store"}]})
    registry.register("acme", flow)
    job_id = jobs.create("acme", JobRequest(flow_id="bis", sink={"type": "jsonl", "path": str(path)}))["job_id"]
    run(ledger, job_id, {5})
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    assert SinkDeliverer(ledger).run_once() == 3
    got = lines(path)
    assert [r["seq"] for r in got] == [0, 1, 2]
    # the good items (indices in the batch: item 5 is index 1) and their outputs
    assert sorted(i for p in got[1]["outputs"]["store"]["parts"] for i in p["items"]) == [0, 2, 3]
    k = ledger.keys.job(job_id)
    assert [ledger.r.exists(k.batch(s)) for s in range(3)] == [0, 1, 0]  # only the bisected one stays
    assert k.batch(1) in ledger._all_keys(job_id) and k.batch(0) not in ledger._all_keys(job_id)
    assert [e["id"] for e in ledger.quarantined(job_id)] == ["1.1"]
    assert ledger.retry_quarantined(job_id, None, "tenant:acme")["retried"] == 1
    stored: list = []
    run(ledger, job_id, set(), stored=stored)  # the platform is fixed
    assert stored == [5] and ledger.job_fields(job_id)["status"] == "succeeded"
    assert ledger.quarantined(job_id) == []
    # the sink had batch 1 without item 5: it gets the item's outputs as an amendment, once
    deliverer = SinkDeliverer(ledger)
    assert deliverer.run_once() == 1 and deliverer.run_once() == 0
    got = lines(path)
    assert [r["id"] for r in got] == [f"{job_id}.{s}" for s in range(3)] + [f"{job_id}.1.r1"]
    amendment = got[3]
    assert (amendment["amends"], amendment["retry"], amendment["item_indices"], amendment["items"]) == (
        f"{job_id}.1", 1, [1], 1)
    assert amendment["outputs"]["store"]["parts"] == [{"items": [1], "output": [{"item": 5}]}]
    assert [p["items"] for p in amendment["outputs"]["score"]["parts"]] == [[1]]
    assert amendment["cursor"] == got[1]["cursor"]
    sink = jobs.view("acme", job_id)["sink"]
    assert (sink["amendments_owed"], sink["amendments_delivered"], sink["error"]) == (0, 1, None)
    assert not ledger.r.exists(k.batch(1)) and k.batch(1) not in ledger._all_keys(job_id)  # delivered


def _bisected_job(jobs, registry, sink):
    flow = parse_flow({"id": "bis", "version": "1", "batching": {"max_items": 4}, "concurrency": 100,
                       "tolerated_failure_percentage": 50, "source": {"type": "sequence", "count": 12},
                       "stages": [{"name": "score", "on_fatal": "bisect"}, {"name": "store"}]})
    registry.register("acme", flow)
    return jobs.create("acme", JobRequest(flow_id="bis", sink=sink))["job_id"]


def _delivered_then_retried(ledger, jobs, registry, sink, poison_after=None):
    """A 12-item job whose item 5 (batch 1, index 1) is quarantined; its 3 batches delivered; the item
    retried and the job run to rest again with ``poison_after`` poison (None: nothing, the platform is
    fixed; a set: run with it). Returns (job id, the deliverer)."""
    from tests.test_bisect import run

    job_id = _bisected_job(jobs, registry, sink)
    run(ledger, job_id, {5})
    deliverer = SinkDeliverer(ledger)
    assert deliverer.run_once() == 3
    assert ledger.retry_quarantined(job_id, None, "tenant:acme")["retried"] == 1
    assert jobs.view("acme", job_id)["sink"]["amendments_owed"] == 1
    if poison_after is not None:
        run(ledger, job_id, poison_after)
    return job_id, deliverer


def test_a_retry_before_delivery_holds_the_chunk_and_needs_no_amendment(ledger, jobs, registry, tmp_path):
    """Quarantined items retried before their batch was delivered: delivery stops before the batch while
    it runs again (no error: it is below the watermark but open), then delivers it whole, the retried
    item's outputs in its record; no amendment is owed."""
    from tests.test_bisect import run

    path = tmp_path / "out" / "held.jsonl"
    job_id = _bisected_job(jobs, registry, {"type": "jsonl", "path": str(path)})
    run(ledger, job_id, {5})
    assert ledger.retry_quarantined(job_id, None, "tenant:acme")["retried"] == 1
    deliverer = SinkDeliverer(ledger)
    assert deliverer.run_once() == 1  # seq 0; seq 1 runs again
    assert jobs.view("acme", job_id)["sink"]["error"] is None
    run(ledger, job_id, set())
    assert deliverer.run_once() == 2
    got = lines(path)
    assert [r["id"] for r in got] == [f"{job_id}.{s}" for s in range(3)]
    assert sorted(i for p in got[1]["outputs"]["store"]["parts"] for i in p["items"]) == [0, 1, 2, 3]
    assert jobs.view("acme", job_id)["sink"]["amendments_owed"] == 0


def test_an_item_quarantined_again_owes_nothing_and_keeps_its_record(ledger, jobs, registry, tmp_path):
    from tests.test_bisect import run

    path = tmp_path / "out" / "again.jsonl"
    job_id, deliverer = _delivered_then_retried(ledger, jobs, registry, {"type": "jsonl", "path": str(path)},
                                                poison_after={5})  # still poison
    assert deliverer.run_once() == 0
    assert len(lines(path)) == 3 and [e["id"] for e in ledger.quarantined(job_id)] == ["1.1"]
    sink = jobs.view("acme", job_id)["sink"]
    assert (sink["amendments_owed"], sink["amendments_delivered"]) == (0, 0)
    ledger.retry_quarantined(job_id, None, "tenant:acme")  # fixed the second time
    run(ledger, job_id, set())
    assert deliverer.run_once() == 1
    assert [r["id"] for r in lines(path)][3:] == [f"{job_id}.1.r2"]


def test_sigkill_mid_amendment_then_restart_writes_it_once(ledger, jobs, registry, tmp_path, settings):
    path = tmp_path / "out" / "killed.jsonl"
    job_id, _ = _delivered_then_retried(ledger, jobs, registry, {"type": "jsonl", "path": str(path)},
                                        poison_after=set())
    dumped = settings.model_dump(mode="json") | {"redis_url": settings.redis_url.get_secret_value()}
    script = KILLED_DELIVERY.format(root=str(ROOT), settings=json.dumps(dumped), kill_at=1)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert path.read_text().count("\n") == 3 and not path.read_text().endswith("\n")  # half a line
    ledger.r.delete(ledger.keys.job(job_id).sink_claim)  # the dead deliverer's (expires in CLAIM_MS)
    assert jobs.view("acme", job_id)["sink"]["amendments_owed"] == 1
    assert SinkDeliverer(ledger).run_once() == 1
    assert [r["id"] for r in lines(path)] == [f"{job_id}.{s}" for s in range(3)] + [f"{job_id}.1.r1"]


def test_an_http_sink_gets_the_amendment_again_after_a_refusal_with_the_same_id(ledger, jobs, registry):
    refuse = [False]
    url, received, stop = _http_sink(lambda n, body: 503 if refuse[0] else 200)
    try:
        job_id, deliverer = _delivered_then_retried(ledger, jobs, registry, {"type": "http", "url": url},
                                                    poison_after=set())
        refuse[0] = True
        assert deliverer.run_once() == 0
        assert "503" in jobs.view("acme", job_id)["sink"]["error"]
        refuse[0] = False
        deliverer._retry_at.clear()
        assert deliverer.run_once() == 1
        assert [r["id"] for r in received] == [f"{job_id}.{s}" for s in range(3)] + [f"{job_id}.1.r1"]
        assert received[3]["outputs"]["store"]["parts"] == [{"items": [1], "output": [{"item": 5}]}]
        assert jobs.view("acme", job_id)["sink"]["amendments_owed"] == 0
    finally:
        stop()


def test_a_folded_job_serves_spec_log_and_audit_and_folds_again_after_a_rewind(api, ledger, jobs, registry,
                                                                               tmp_path):
    """A job at rest whose results are delivered folds its spec and streams into one value (archive.py);
    the API reads them from there (paging by ``after`` across the past and the new stream), a rewind
    runs it again with fresh streams, and its next rest folds both together, losing no audit entry."""
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=12, stages=("only",))
    drain(ledger, job_id, output)
    SinkDeliverer(ledger).run_once()
    k = ledger.keys.job(job_id)
    assert ledger.r.exists(k.past) and not any(ledger.r.exists(key) for key in (k.spec, k.log, k.audit))
    ledger.forget(job_id)  # no spec cached in this process: read from the past
    log = api.get(f"/v1/jobs/{job_id}/log").json()["entries"]
    assert [e["event"] for e in log if e["event"] == "stage_completed"] == ["stage_completed"] * 4
    page = api.get(f"/v1/jobs/{job_id}/log", params={"limit": 3}).json()["entries"]
    rest = api.get(f"/v1/jobs/{job_id}/log", params={"after": page[-1]["id"]}).json()["entries"]
    assert page + rest == log
    assert [e["event"] for e in api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]] == ["job_created"]
    assert api.get(f"/v1/jobs/{job_id}").json()["flow"]["id"] == "f1"
    assert api.get("/v1/jobs").json()["jobs"][0]["job_id"] == job_id  # the listing reads the past's spec

    cursor = lines(path)[2]["cursor"]
    jobs.resume("acme", job_id, ResumeRequest(cursor=cursor, reason="redo from batch 2"), "op")
    drain(ledger, job_id, output)
    audit = [e["event"] for e in api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]]
    assert audit[0] == "job_created" and "cursor_moved" in audit  # the past's, then the new stream's
    log_before = api.get(f"/v1/jobs/{job_id}/log").json()["entries"]
    assert log_before[:len(log)] == log and len(log_before) > len(log)
    SinkDeliverer(ledger).run_once()  # at rest again: folds the new entries into the past
    assert not ledger.r.exists(k.audit) and not ledger.r.exists(k.log)
    assert [e["event"] for e in api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]] == audit
    assert api.get(f"/v1/jobs/{job_id}/log").json()["entries"] == log_before
    assert [r["seq"] for r in lines(path)] == [0, 1, 2, 3, 4, 5]


def test_folding_refuses_when_an_entry_came_in_after_the_read(ledger, jobs, registry, tmp_path, monkeypatch):
    """archive.lua is a compare-and-set on what fold() read: an audit entry appended in between (an
    operator acting on the job) makes it answer 'raced' and remove nothing; the next fold takes it."""
    path = tmp_path / "out" / "r.jsonl"
    job_id = new_job(jobs, registry, {"type": "jsonl", "path": str(path)}, items=6)
    drain(ledger, job_id, output)
    k = ledger.keys.job(job_id)
    real = ledger.scripts.archive

    def late_entry(keys, args):
        ledger.r.xadd(k.audit, {"event": "note", "actor": "op"})  # after the read, before the script
        return real(keys=keys, args=args)

    monkeypatch.setattr(ledger, "scripts", dataclasses.replace(ledger.scripts, archive=late_entry))
    SinkDeliverer(ledger).run_once()
    assert not ledger.r.exists(k.past) and ledger.r.xlen(k.audit) == 2  # nothing folded, nothing lost
    monkeypatch.undo()
    assert ledger.r.sismember(ledger.keys.sink_jobs, job_id)  # followed again: the next pass folds it
    SinkDeliverer(ledger).run_once()
    assert ledger.r.exists(k.past) and not ledger.r.exists(k.audit)
    assert [f["event"] for _, f in archive.entries(ledger.r, k, "audit")] == ["job_created", "note"]


def test_a_csv_sink_gets_an_amendment_as_one_more_row_under_the_same_header(ledger, jobs, registry, tmp_path):
    path = tmp_path / "out" / "bisected.csv"
    job_id, deliverer = _delivered_then_retried(ledger, jobs, registry, {"type": "csv", "path": str(path)},
                                                poison_after=set())
    assert deliverer.run_once() == 1
    assert path.read_text().count("id,job_id,seq") == 1  # one header
    rows = list(csv.DictReader(path.open()))
    assert [r["id"] for r in rows] == [f"{job_id}.{s}" for s in range(3)] + [f"{job_id}.1.r1"]
    assert (rows[3]["seq"], rows[3]["items"]) == ("1", "1")
    assert json.loads(rows[3]["store"]) == {"parts": [{"items": [1], "output": [{"item": 5}]}]}


def test_a_rewind_before_the_retry_commits_drops_the_amendment_it_owed(ledger, jobs, registry, tmp_path):
    """A delivered batch re-opened for its quarantined item, then superseded by a resume by cursor
    before it committed: nothing of it is sent again (the new plan's batches are), the amendment it owed
    is dropped, and the job retires at rest."""
    from tests.test_bisect import run

    path = tmp_path / "out" / "rewound.jsonl"
    job_id, deliverer = _delivered_then_retried(ledger, jobs, registry, {"type": "jsonl", "path": str(path)})
    ledger.replan(job_id, {"type": "offset", "offset": 8}, "op", "again from item 8")
    assert ledger.batch_record(job_id, 1)["status"] == "superseded"
    run(ledger, job_id, set())
    deliverer.run_once()
    got = lines(path)
    assert [r["seq"] for r in got][:3] == [0, 1, 2] and not any("amends" in r for r in got)
    assert [r["cursor"]["offset"] for r in got[3:] if r["items"]] == [8]  # the new plan's batch
    sink = jobs.view("acme", job_id)["sink"]
    assert (sink["amendments_owed"], sink["amendments_delivered"], sink["error"]) == (0, 0, None)
    assert ledger.r.sismember(ledger.keys.sink_jobs, job_id) == 0  # at rest: retired
