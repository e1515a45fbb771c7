"""Logs as an operator reads them: JSON lines with the job's fields, an access log, and no secret.

The full run starts `batchgate serve` (gunicorn, access log on), `batchgate supervisor` and `batchgate
worker` as processes with BATCHGATE_LOG_FORMAT=json at DEBUG, credentials from a config file, and runs
a pull job (lease tokens), a push job whose platform needs a secret and answers by callback (signed
callback URLs in the access log), and requests with a wrong token. Every line every process wrote must
parse as JSON, lines about the jobs must name them, and no token, secret, signing key, lease token or
callback token may appear anywhere in the output.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import requests

from gateway import logs
from gateway.ledger.embedded import free_port
from gateway.runtime import procs
from gateway.settings import Settings
from tests.platforms import FakeHttpPlatform, OnceCallbackPlatform

pytestmark = pytest.mark.slow
TOKEN = "tok-logs-5b1d9e77c3a2"
SECRET = "platform-secret-0c8f2d41"
SIGNING_KEY = "signing-logs-7e21b9a4f0"


def record(msg: str, *args, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("gateway.test", logging.WARNING, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_carry_the_job_fields_from_context_extra_and_message():
    fmt = logs.formatter("json", [TOKEN, SECRET])
    with logs.bind(job_id="job_a", seq=3, stage="score", attempt=2, tenant="acme"):
        line = json.loads(fmt.format(record("stage call failed")))
    assert {k: line[k] for k in logs.FIELDS} == {"job_id": "job_a", "seq": 3, "stage": "score",
                                                 "attempt": 2, "tenant": "acme"}
    assert line["level"] == "WARNING" and line["logger"] == "gateway.test" and line["ts"].endswith("Z")
    line = json.loads(fmt.format(record("job retired job_id=%s seq=%s", "job_b", 7)))
    assert line["job_id"] == "job_b" and line["seq"] == 7  # pairs in the message
    line = json.loads(fmt.format(record("x", job_id="job_c")))
    assert line["job_id"] == "job_c" and "seq" not in line  # outside a bind: nothing left over
    try:
        raise ValueError(f"bad answer with {SECRET}")
    except ValueError:
        import sys as _sys

        rec = record("failed with token %s", TOKEN)
        rec.exc_info = _sys.exc_info()
    text = fmt.format(rec)
    assert TOKEN not in text and SECRET not in text and "[redacted]" in text
    assert "ValueError" in json.loads(text)["exc"]
    text = logs.formatter("text", [TOKEN]).format(record(f"POST /v1/callbacks/abcdefSECRETPART {TOKEN}"))
    assert "SECRETPART" not in text and "/v1/callbacks/abcdef" in text and TOKEN not in text


def test_a_full_run_logs_json_with_job_fields_and_no_secret(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"tokens": {TOKEN: "acme"}, "signing_key": SIGNING_KEY,
                                  "secrets": {"acme": {"key": SECRET}}}))
    config.chmod(0o600)
    port = free_port()
    settings = Settings(data_dir=tmp_path / "data", config_file=config)
    redis_srv = procs.start_embedded(settings)
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in procs.child_env(settings, redis_srv.url, {}).items()}
    env.update(BATCHGATE_CONFIG_FILE=str(config), BATCHGATE_LOG_FORMAT="json", BATCHGATE_LOG_LEVEL="DEBUG",
               BATCHGATE_PUBLIC_URL=base, BATCHGATE_OUTBOUND_ALLOW='["127.0.0.1/32"]',
               BATCHGATE_SUPERVISOR_INTERVAL="0.2", BATCHGATE_PORT=str(port), BATCHGATE_HOST="127.0.0.1")
    outs = {name: tmp_path / f"{name}.out" for name in ("serve", "supervisor", "worker")}
    children = []
    callback = OnceCallbackPlatform(0.05, 0.2)
    secured = FakeHttpPlatform(auth=f"Bearer {SECRET}").__enter__()
    lease_tokens: list[str] = []
    try:
        for name in outs:
            with open(outs[name], "w") as out:
                children.append(subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", name], env=env,
                                                 stdout=out, stderr=subprocess.STDOUT,
                                                 start_new_session=True))
        procs.wait_healthy(base, timeout_s=30, proc=children[0])
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {TOKEN}"
        flows = [
            {"id": "pull", "version": "1", "batching": {"max_items": 2},
             "source": {"type": "sequence", "count": 4}, "stages": [{"name": "work"}]},
            {"id": "push", "version": "1", "batching": {"max_items": 2},
             "source": {"type": "sequence", "count": 4},
             "stages": [{"name": "call", "target": {"type": "http", "url": callback.url, "mode": "callback"}},
                        {"name": "secured", "target": {"type": "http", "url": secured.url, "mode": "sync",
                                                        "auth_secret": "key"}}]}]
        for flow in flows:
            assert s.post(f"{base}/v1/flows", json=flow).status_code == 201, flow["id"]
        pull = s.post(f"{base}/v1/jobs", json={"flow_id": "pull"}).json()["job_id"]
        push = s.post(f"{base}/v1/jobs", json={"flow_id": "push"}).json()["job_id"]
        while (lease := s.post(f"{base}/v1/jobs/{pull}/lease")).status_code == 200:
            body = lease.json()
            lease_tokens.append(body["lease_token"])
            assert s.post(f"{base}/v1/jobs/{pull}/batches/{body['seq']}/complete",
                          json={"lease_token": body["lease_token"], "output": {}}).status_code == 200
        assert requests.get(f"{base}/v1/jobs", headers={"Authorization": "Bearer wrong-token-123456"},
                            timeout=5).status_code == 401
        deadline = time.monotonic() + 60
        while s.get(f"{base}/v1/jobs/{push}").json()["status"] != "succeeded":
            assert time.monotonic() < deadline, s.get(f"{base}/v1/jobs/{push}").text
            time.sleep(0.2)
        time.sleep(0.5)  # the supervisor retires both
    finally:
        procs.stop_all(children)
        callback.close()
        secured.__exit__(None, None, None)
        redis_srv.stop()
    callback_tokens = [url.rsplit("/", 1)[1] for url in callback.callback_urls]
    assert len(lease_tokens) == 2 and len(callback_tokens) == 2
    everything = ""
    for name, path in outs.items():
        text = path.read_text()
        everything += text
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert lines, f"{name} logged nothing"
        parsed = []
        for ln in lines:
            try:
                parsed.append(json.loads(ln))
            except ValueError:
                pytest.fail(f"{name} wrote a line that is not JSON: {ln[:300]}")
        assert all({"ts", "level", "logger", "msg"} <= set(p) for p in parsed), name
        if name == "serve":
            access = [p for p in parsed if "status" in p and "path" in p]
            assert any(p["path"] == f"/v1/jobs/{pull}/lease" and p["method"] == "POST" for p in access)
            assert any(p["path"].startswith("/v1/callbacks/") for p in access)
            assert any(p["status"] == 401 for p in access)
        if name == "worker":
            calls = [p for p in parsed if p.get("job_id") == push and "stage" in p and "seq" in p]
            assert calls, "the worker's lines about its stage calls name the job, seq and stage"
    for secret in (TOKEN, SECRET, SIGNING_KEY, "wrong-token-123456", *lease_tokens, *callback_tokens):
        assert secret not in everything, secret[:6]
    assert auths_seen(secured) == {f"Bearer {SECRET}"}  # the secret was used: the check means something


def auths_seen(platform) -> set[str]:
    return {r.headers.get("Authorization") for r in platform.requests}
