"""The s3 result sink (docs/design.md "Result sinks and compaction"): committed outputs go to an
S3-compatible bucket through boto3, here moto's S3 server on a loopback port (a real socket); every
delivered batch lands in exactly one object, a dead delivery's object is replaced rather than added to,
a bucket that is down, hangs or refuses keeps the records in Redis, and a tenant writes only where
BATCHGATE_SINK_S3_BUCKETS lets it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from gateway.errors import InvalidRequest
from gateway.ledger.flows import parse_flow
from gateway.ledger.ledger import Ledger
from gateway.ledger.results import check_sink_s3
from gateway.push.sinks import SinkDeliverer
from gateway.settings import Settings
from tests.conftest import TOKEN, drain
from tests.test_sinks import KILLED_AFTER, new_job, output
from tests.test_webhooks import free_port

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3-secret-never-logged-0123456789"


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 on a free loopback port, with bucket ``results``; yields (endpoint, boto3 client, server)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "batchgate-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask an instance metadata address
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    requests.post(f"{endpoint}/moto-api/reset", timeout=5)  # moto's buckets live in this process: start empty
    client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="results")
    try:
        yield endpoint, client, server
    finally:
        server.stop()


@pytest.fixture
def settings(redis_server, tmp_path, s3):
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"},
                    sink_s3_buckets={"acme": ["results/acme/"], "*": ["shared"]}, s3_endpoint_url=s3[0],
                    s3_region="us-east-1", sink_chunk=4, sink_timeout=0.5, sink_grace=0)


def objects(client, bucket="results", prefix="") -> dict[str, list[dict]]:
    """Every object under ``prefix``: its JSONL records."""
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: [json.loads(line) for line in
                       client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read().decode().splitlines()]
            for o in listed}


def seqs(found: dict[str, list[dict]]) -> list[int]:
    return sorted(r["seq"] for records in found.values() for r in records)


def test_s3_sink_gets_every_batch_once_in_objects_per_chunk_and_records_compact(ledger, jobs, registry, s3):
    _, client, _ = s3
    job_id = new_job(jobs, registry, {"type": "s3", "bucket": "results", "prefix": "acme/screening/"})
    drain(ledger, job_id, output)
    assert SinkDeliverer(ledger).run_once() == 10
    found = objects(client)
    assert sorted(found) == [f"acme/screening/{job_id}/{first:012d}.jsonl" for first in (0, 4, 8)]
    assert seqs(found) == list(range(10))
    record = found[f"acme/screening/{job_id}/000000000004.jsonl"][1]
    assert record["id"] == f"{job_id}.5" and record["items"] == 3
    assert record["outputs"] == {"score": {"stage": "score", "first": 15},
                                 "store": {"stage": "store", "first": 15}}
    k = ledger.keys.job(job_id)
    assert not any(ledger.r.exists(k.batch(s)) for s in range(10))  # compacted: the bucket holds them now
    view = jobs.view("acme", job_id)
    assert view["sink"] | {} == {"type": "s3", "delivered_below_seq": 10, "batches_delivered": 10,
                                 "items_delivered": 30, "behind": 0, "amendments_owed": 0,
                                 "amendments_delivered": 0, "error": None, "error_ms": None}
    assert ledger.r.sismember(ledger.keys.sink_jobs, job_id) == 0


def test_an_amendment_is_an_object_of_its_own_written_again_not_twice(ledger, jobs, registry, s3, settings):
    """A quarantined item retried after its batch reached the bucket: its outputs arrive as the object
    ``<seq>.r<retry>.jsonl``; a delivery that dies after the PUT (before amend.lua) writes the same
    object again, so the bucket still holds one amendment."""
    from tests.test_sinks import _delivered_then_retried

    _, client, _ = s3
    job_id, deliverer = _delivered_then_retried(ledger, jobs, registry,
                                                {"type": "s3", "bucket": "results", "prefix": "acme/"},
                                                poison_after=set())
    dumped = settings.model_dump(mode="json") | {"redis_url": settings.redis_url.get_secret_value()}
    script = KILLED_AFTER.format(root=str(ROOT), settings=json.dumps(dumped), method="_put", kill_on=1)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert jobs.view("acme", job_id)["sink"]["amendments_owed"] == 1  # put, not recorded
    ledger.r.delete(ledger.keys.job(job_id).sink_claim)  # (the dead claim expires in CLAIM_MS)
    assert deliverer.run_once() == 1
    found = objects(client, prefix=f"acme/{job_id}/")
    assert sorted(found) == [f"acme/{job_id}/000000000000.jsonl", f"acme/{job_id}/000000000001.r1.jsonl"]
    [amendment] = found[f"acme/{job_id}/000000000001.r1.jsonl"]
    assert amendment["amends"] == f"{job_id}.1" and amendment["item_indices"] == [1]
    assert amendment["outputs"]["store"]["parts"] == [{"items": [1], "output": [{"item": 5}]}]
    assert jobs.view("acme", job_id)["sink"]["amendments_delivered"] == 1


def test_a_tenant_writes_only_the_buckets_and_prefixes_it_is_granted(jobs, registry, ledger, s3):
    def refused(sink):
        with pytest.raises(InvalidRequest) as exc:
            new_job(jobs, registry, sink)
        return str(exc.value)

    assert "not one tenant acme may write" in refused({"type": "s3", "bucket": "results", "prefix": "other/"})
    assert "not one tenant acme may write" in refused({"type": "s3", "bucket": "results"})  # no prefix: all
    assert "not one tenant acme may write" in refused({"type": "s3", "bucket": "other", "prefix": "acme/"})
    assert "bucket name" in refused({"type": "s3", "bucket": "Results/../x"})
    assert "bucket name" in refused({"type": "s3", "bucket": "127.0.0.1"})
    assert "bucket name" in refused({"type": "s3"})
    assert "'..'" in refused({"type": "s3", "bucket": "results", "prefix": "acme/../beta/"})
    assert "'/'" in refused({"type": "s3", "bucket": "results", "prefix": "/acme/"})
    assert "takes no path" in refused({"type": "s3", "bucket": "results", "path": "/tmp/x"})
    assert "takes no bucket" in refused({"type": "jsonl", "path": "/tmp/x.jsonl", "bucket": "results"})
    # the shared grant: any prefix in bucket "shared"
    new_job(jobs, registry, {"type": "s3", "bucket": "shared", "prefix": "x/"}, name="f2")
    # no grant at all: s3 sinks are off
    off = Settings(**{**ledger.settings.model_dump(), "sink_s3_buckets": {}})
    with pytest.raises(InvalidRequest, match="s3 sinks are off"):
        check_sink_s3({"type": "s3", "bucket": "results", "prefix": "acme/"}, off, "acme")
    with pytest.raises(InvalidRequest, match="not one tenant beta may write"):
        check_sink_s3({"type": "s3", "bucket": "results", "prefix": "acme/"}, ledger.settings, "beta")


def test_the_api_answers_a_refused_s3_sink_with_a_problem_and_writes_no_job(api, registry):
    registry.register("acme", parse_flow(
        {"id": "f", "version": "1", "stages": [{"name": "s"}], "source": {"type": "sequence", "count": 3}}))
    resp = api.post("/v1/jobs", json={"flow_id": "f", "sink": {"type": "s3", "bucket": "results",
                                                               "prefix": "beta/"}})
    assert resp.status_code == 422 and resp.headers["Content-Type"].startswith("application/problem+json")
    assert "BATCHGATE_SINK_S3_BUCKETS" in resp.json()["detail"]
    assert api.get("/v1/jobs").json()["jobs"] == []
    ok = api.post("/v1/jobs", json={"flow_id": "f", "sink": {"type": "s3", "bucket": "results",
                                                             "prefix": "acme/"}})
    assert ok.status_code == 201, ok.text
    assert api.get(f"/v1/jobs/{ok.json()['job_id']}").json()["sink"]["type"] == "s3"


def test_a_bucket_down_hung_or_refusing_keeps_the_records_and_shows_the_error(ledger, jobs, registry, s3,
                                                                               caplog):
    endpoint, client, server = s3
    job_id = new_job(jobs, registry, {"type": "s3", "bucket": "results", "prefix": "acme/"}, items=12)
    drain(ledger, job_id, output)
    k = ledger.keys.job(job_id)

    def attempt(settings):
        deliverer = SinkDeliverer(Ledger(ledger.r, settings))
        deliverer.run_once()
        return jobs.view("acme", job_id)["sink"]

    # refused: the bucket is gone (NoSuchBucket)
    client.delete_bucket(Bucket="results")
    view = attempt(ledger.settings)
    assert view["delivered_below_seq"] == 0 and "NoSuchBucket" in view["error"]
    client.create_bucket(Bucket="results")
    # hung: an endpoint that takes the connection and never answers (the client times out)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    try:
        view = attempt(ledger.settings.model_copy(
            update={"s3_endpoint_url": f"http://127.0.0.1:{hung.getsockname()[1]}"}))
    finally:
        hung.close()
    assert view["delivered_below_seq"] == 0 and "could not be reached" in view["error"]
    # down: nothing listens
    server.stop()
    view = attempt(ledger.settings)
    assert view["delivered_below_seq"] == 0 and "could not be reached" in view["error"]
    assert all(ledger.r.exists(k.batch(s)) for s in range(4))  # nothing undelivered compacted
    assert jobs.batch("acme", job_id, 1)["stages"]["store"]["output"] == {"stage": "store", "first": 3}
    # back: everything arrives once, and the error clears
    server.start()
    view = attempt(ledger.settings)
    assert view["delivered_below_seq"] == 4 and view["error"] is None
    assert seqs(objects(client)) == list(range(4))
    assert SECRET not in caplog.text and SECRET not in json.dumps(jobs.view("acme", job_id))


def test_sigkill_after_a_put_replaces_the_object_and_duplicates_no_batch(ledger, jobs, registry, settings,
                                                                         s3):
    _, client, _ = s3
    job_id = new_job(jobs, registry, {"type": "s3", "bucket": "results", "prefix": "acme/"})
    drain(ledger, job_id, output)
    dumped = settings.model_dump(mode="json") | {"redis_url": settings.redis_url.get_secret_value()}
    script = KILLED_AFTER.format(root=str(ROOT), settings=json.dumps(dumped), method="_put", kill_on=2)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert jobs.view("acme", job_id)["sink"]["delivered_below_seq"] == 4  # the first chunk recorded only
    assert seqs(objects(client)) == list(range(8))  # the second chunk's object is there, unrecorded
    ledger.r.delete(ledger.keys.job(job_id).sink_claim)  # (the dead claim expires in CLAIM_MS)
    # the next delivery runs from seq 4 with a bigger chunk: it writes object 4 again, now seqs 4-9
    SinkDeliverer(Ledger(ledger.r, settings.model_copy(update={"sink_chunk": 10}))).run_once()
    found = objects(client)
    assert sorted(found) == [f"acme/{job_id}/{first:012d}.jsonl" for first in (0, 4)]
    assert seqs(found) == list(range(10))  # each batch once
    assert jobs.view("acme", job_id)["sink"]["delivered_below_seq"] == 10


def test_deliveries_racing_on_one_job_write_each_batch_once(ledger, jobs, registry, s3):
    """Two deliverers (two supervisors) on one job at once: the claim lets one write; the bucket holds
    each batch once."""
    _, client, _ = s3
    job_id = new_job(jobs, registry, {"type": "s3", "bucket": "results", "prefix": "acme/"}, items=60)
    drain(ledger, job_id, output)
    deliverers = [SinkDeliverer(Ledger(ledger.r, ledger.settings), name=f"d{i}") for i in range(2)]
    threads = [threading.Thread(target=d.run_once) for d in deliverers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for d in deliverers:  # whichever did not get the claim takes what is left
        d.run_once()
    assert seqs(objects(client)) == list(range(20))
    assert jobs.view("acme", job_id)["sink"]["delivered_below_seq"] == 20
