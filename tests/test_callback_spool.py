"""Callbacks that arrive while Redis is down are spooled and committed later: no paid re-run.

Issue 15: platforms post a callback once; while Redis was down each got a 503, was lost, and its batch
ran again (paid) once the lease ran out: up to 15 in one 5 s outage. The stand-in here posts each
callback exactly once, never retrying, and counts the runs it is paid for per idempotency key.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from pydantic import SecretStr

from gateway.api.spool import CallbackSpool
from gateway.errors import StaleLease
from gateway.ledger.embedded import EmbeddedRedis, client_for
from tests.platforms import OnceCallbackPlatform
from tests.test_worker_concurrency import stack

BATCHES = 200


@pytest.mark.slow
def test_a_5_s_redis_outage_during_200_callbacks_costs_no_paid_rerun(settings, tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    client = client_for(url)
    own = settings.model_copy(update={"redis_url": SecretStr(url), "callback_grace": timedelta(seconds=2)})
    platform = OnceCallbackPlatform(0.1, 0.8, seed=7)
    flow = {"id": "cb", "version": "1", "batching": {"max_items": 1}, "concurrency": 16,
            "source": {"type": "sequence", "count": BATCHES},
            "stages": [{"name": "score", "lease": 10, "idempotent": False,
                        "retry": {"initial_interval": 0.1, "maximum_attempts": 3},
                        "target": {"type": "http", "url": platform.url, "mode": "callback",
                                   "max_in_flight": 16}}]}
    try:
        with stack(own, client, tmp_path / "data") as s:
            s.worker(16)
            assert s.api.post("/v1/flows", json=flow).status_code == 201
            job_id = s.api.post("/v1/jobs", json={"flow_id": "cb"}).json()["job_id"]
            deadline = time.monotonic() + 60
            while int(client.hget(s.ledger.keys.job(job_id).job, "n_done") or 0) < 40:
                assert time.monotonic() < deadline, "no progress before the outage"
                time.sleep(0.05)
            server.kill()  # SIGKILL: callbacks keep arriving for the calls in flight
            time.sleep(5)
            server = EmbeddedRedis(tmp_path / "redis")
            assert server.start() == url
            done = s.wait_done(job_id, 120)
            log = s.log(job_id)
            records = s.batches(job_id, BATCHES)
    finally:
        platform.close()
        server.stop()
    assert done["status"] == "succeeded" and done["batches"]["completed"] == BATCHES, done
    assert platform.posted[202] > 0, platform.posted  # the outage met callbacks
    assert set(platform.posted) <= {200, 202}, platform.posted
    assert len(platform.runs) == BATCHES
    assert not platform.reruns(), f"paid re-runs: {platform.reruns()}"
    # no attempt spent but the one that ran; a call that could not begin while Redis was down is
    # released without spending one ("no attempt spent"), as in tests/test_chaos.py
    spent = {seq: int(r["attempt"]) - int(r.get("unspent") or 0) for seq, r in enumerate(records)}
    assert spent == {seq: 1 for seq in range(BATCHES)}, {k: v for k, v in spent.items() if v != 1}
    assert not [e for e in log if e["event"] == "batch_failed" or (
        e["event"] == "retry_scheduled" and "no attempt spent" not in e.get("error", ""))]
    assert not list((tmp_path / "data" / "callback-spool").glob("*.json"))  # all replayed


def _spool(tmp_path, replay):
    return CallbackSpool(tmp_path / "spool", replay)


def test_the_spool_replays_in_arrival_order_and_keeps_files_while_redis_is_down(tmp_path):
    import redis

    seen, down = [], [True]

    def replay(token, answer):
        if down[0]:
            raise redis.ConnectionError("down")
        seen.append((token, answer))
        return {"duplicate": False}

    spool = _spool(tmp_path, replay)
    spool.stop.set()  # drive it by hand
    for n in range(5):
        spool.keep(f"t{n}", {"n": n})
    with pytest.raises(redis.ConnectionError):
        spool.replay_once()
    assert len(spool.pending()) == 5 and seen == []
    down[0] = False
    assert spool.replay_once() is False
    assert seen == [(f"t{n}", {"n": n}) for n in range(5)] and spool.pending() == []


def test_a_refused_spooled_answer_is_dropped_and_a_broken_one_set_aside(tmp_path):
    def replay(token, answer):
        if token == "stale":
            raise StaleLease("lease token is not current")
        if token == "bug":
            raise RuntimeError("boom")
        return {}

    spool = _spool(tmp_path, replay)
    spool.stop.set()
    for token in ("stale", "bug", "ok"):
        spool.keep(token, {})
    (spool.folder / "00000000000000000000-1-torn.json").write_text("{not json")
    assert spool.replay_once() is False
    assert sorted(p.suffix for p in spool.folder.iterdir() if not p.name.startswith(".")) == [
        ".failed", ".failed"]  # the unreadable file and the one that raised: kept for a person


def test_a_spooled_callback_answers_202_and_commits_when_redis_returns(settings, tmp_path):
    """Through the API on a real socket: the platform's one post is accepted during the outage."""
    from gateway.api.app import create_app
    from gateway.ledger.ledger import Ledger
    from gateway.push.dispatch import Dispatcher
    from tests.conftest import TOKEN
    from tests.http import ApiClient, serve_app
    from tests.platforms import FakeHttpPlatform
    from tests.test_callbacks import callback_flow

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    client = client_for(url)
    own = settings.model_copy(update={"redis_url": SecretStr(url), "outbound_allow": ["127.0.0.1/32"],
                                      "data_dir": tmp_path / "data"})
    holder = {}
    base, stop = serve_app(lambda env, start: holder["app"](env, start))
    own = own.model_copy(update={"public_url": base})
    holder["app"] = create_app(own, client)
    api = ApiClient(base, TOKEN)
    try:
        with FakeHttpPlatform() as platform:
            platform.plan("accepted")
            assert api.post("/v1/flows", json=callback_flow(platform.url)).status_code == 201
            job_id = api.post("/v1/jobs", json={"flow_id": "cb"}).json()["job_id"]
            ledger = Ledger(client, own)
            lease = ledger.lease_stages(job_id, [0])
            Dispatcher.build(own, ledger).run_leased(ledger.spec(job_id), lease)
            env = platform.requests[-1].json
        server.kill()
        answer = {"status": "succeeded", "output": {"n": 3}}
        resp = api.session.post(env["callback_url"], json=answer)
        assert resp.status_code == 202, resp.text
        assert resp.json()["spooled"] is True and "callback_url" not in resp.text
        bad = api.session.post(env["callback_url"], json={"status": "maybe"})
        assert bad.status_code == 422  # a malformed answer is refused, not spooled
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        deadline = time.monotonic() + 20
        while (batch := api.get(f"/v1/jobs/{job_id}/batches/0")).status_code != 200 or \
                batch.json()["stages"]["process"]["status"] != "completed":
            assert time.monotonic() < deadline, batch.text
            time.sleep(0.05)
        assert batch.json()["stages"]["process"]["output"] == {"n": 3}
        again = api.session.post(env["callback_url"], json=answer)  # the platform's late retry
        assert again.status_code == 200 and again.json()["duplicate"] is True
    finally:
        stop()
        server.stop()


def test_a_callback_the_spool_cannot_keep_gets_the_503_the_platform_can_retry(settings, tmp_path):
    """A full or broken disk: nothing is kept, so the platform must hear that nothing was taken."""
    from gateway.api.app import create_app
    from gateway.security import sign
    from tests.conftest import TOKEN
    from tests.http import ApiClient, serve_app

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    data = tmp_path / "data"
    data.mkdir()
    (data / "callback-spool").write_text("not a folder")  # every write into it fails
    own = settings.model_copy(update={"redis_url": SecretStr(url), "data_dir": data})
    holder = {}
    base, stop = serve_app(lambda env, start: holder["app"](env, start))
    holder["app"] = create_app(own.model_copy(update={"public_url": base}), client_for(url))
    try:
        server.kill()
        token = sign({"j": "job_x", "s": 0, "st": 0, "a": 1, "t": "tok"}, own.signing_secret(), "callback", 60)
        resp = ApiClient(base, TOKEN).session.post(f"{base}/v1/callbacks/{token}",
                                                   json={"status": "succeeded", "output": {}})
        assert resp.status_code == 503 and resp.headers["Retry-After"], resp.text
    finally:
        stop()
        server.stop()
