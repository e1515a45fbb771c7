"""Secrets belong to tenants, credentials stay out of logs and child environments, flows are immutable
for good, signed tokens are strict. Through the live API and real processes where it matters."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError
from rq import SimpleWorker
from rq.serializers import JSONSerializer

import gateway.api.callbacks
import gateway.push.dispatch
from gateway.runtime import procs
from gateway.api.app import create_app
from gateway.push.dispatch import Dispatcher
from gateway.ledger.embedded import free_port
from gateway.ledger.ledger import Ledger
from gateway.security import redact_path, sign, verify
from gateway.settings import Settings
from tests.conftest import OTHER_TOKEN, TOKEN
from tests.http import ApiClient, serve_app
from tests.platforms import FakeHttpPlatform

ACME_KEY = "acme-only-9f3b2c71d0"
ACME_OWN_N8N = "acme-own-n8n-51e0aa"
SHARED_KEY = "shared-by-all-7c1d42"
SHARED_N8N = "shared-n8n-0b8e93"
SECRETS = {"acme": {"acme_key": ACME_KEY, "n8n_key": ACME_OWN_N8N},
           "*": {"shared_key": SHARED_KEY, "n8n_key": SHARED_N8N}}
SIGNING_KEY = "signing-key-3a9e1f0c7b"


@dataclass
class Stack:
    acme: ApiClient
    globex: ApiClient
    settings: Settings
    dispatcher: Dispatcher
    ledger: Ledger


@pytest.fixture
def stack(redis_server, redis_client, tmp_path):
    """The API on a real socket with per-tenant secrets, loopback targets allowed, and a dispatcher."""
    holder: dict = {}
    base, stop = serve_app(lambda environ, start: holder["app"](environ, start))
    settings = Settings(redis_url=redis_server.url, data_dir=tmp_path / "data",
                        tokens={TOKEN: "acme", OTHER_TOKEN: "globex"}, secrets=SECRETS,
                        signing_key=SIGNING_KEY, outbound_allow=["127.0.0.1/32"], public_url=base)
    holder["app"] = create_app(settings, redis_client)
    ledger = Ledger(redis_client, settings)
    yield Stack(ApiClient(base, TOKEN), ApiClient(base, OTHER_TOKEN), settings,
                Dispatcher.build(settings, ledger), ledger)
    stop()


def http_flow(url: str, secret: str | None, fid: str = "f", version: str = "1", count: int = 4,
              mode: str = "sync") -> dict:
    target = {"type": "http", "url": url, "mode": mode, **({"auth_secret": secret} if secret else {})}
    return {"id": fid, "version": version, "batching": {"max_items": 2},
            "source": {"type": "sequence", "count": count},
            "stages": [{"name": "call", "lease": 5, "target": target,
                        "retry": {"initial_interval": 0.05, "maximum_attempts": 1}}]}


def run_push(stack: Stack, monkeypatch) -> None:
    """Run every fed job's ready stage calls, then every queued RQ job (polls), in this process."""
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", stack.dispatcher)
    for job_id in stack.dispatcher.fed_jobs(rescan=True):
        stack.dispatcher.run_ready(job_id)
    queue = stack.dispatcher.queue
    SimpleWorker([queue], connection=queue.connection, serializer=JSONSerializer).work(burst=True)


def committed_lease_tokens(stack: Stack, job_id: str, batches: int) -> list[str]:
    """The lease tokens the job's calls ran under (each batch keeps its committing one: "attempt token")."""
    out = []
    for seq in range(batches):
        record = stack.ledger.batch_record(job_id, seq)
        out += [v.split(" ", 1)[1] for k, v in record.items() if k.startswith("c:") and " " in v]
    return out


def auths(platform: FakeHttpPlatform) -> set[str | None]:
    return {r.headers.get("Authorization") for r in platform.requests}


# -- secrets belong to tenants -------------------------------------------------------------------


def test_flat_secrets_are_refused_with_a_migration_hint(monkeypatch):
    with pytest.raises(ValidationError) as caught:
        Settings(secrets={"dify_app": "app-flat-value-123"})
    text = str(caught.value)
    assert "dify_app" in text and '"*"' in text and "app-flat-value-123" not in text
    monkeypatch.setenv("BATCHGATE_SECRETS", json.dumps({"dify_app": "app-flat-value-123"}))
    # a server command stops on it (the HTTP-only commands read no server settings: test_cli.py)
    result = subprocess.run([sys.executable, "-m", "gateway.runtime.cli", "supervisor"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "flat form" in result.stderr and "app-flat-value-123" not in result.stderr
    with pytest.raises(ValidationError):  # "*" is the shared entry, never a tenant
        Settings(tokens={"t-star-0123456789": "*"})


def test_settings_repr_shows_no_token_or_secret(stack):
    shown = repr(stack.settings) + str(stack.settings)
    for value in (TOKEN, OTHER_TOKEN, ACME_KEY, SHARED_KEY, SIGNING_KEY):
        assert value not in shown


def test_globex_cannot_register_a_flow_naming_acmes_secret(stack):
    with FakeHttpPlatform() as platform:
        resp = stack.globex.post("/v1/flows", json=http_flow(platform.url, "acme_key"))
        unknown = stack.globex.post("/v1/flows", json=http_flow(platform.url, "no_such_key"))
    assert resp.status_code == 422 and resp.json()["missing"] == [
        {"stage": "call", "field": "auth_secret", "secret": "acme_key"}]
    # no oracle: another tenant's secret reads exactly like one nobody has
    detail = resp.json()["detail"]
    assert detail.replace("acme_key", "X") == unknown.json()["detail"].replace("no_such_key", "X")
    assert ACME_KEY not in resp.text
    assert stack.globex.get("/v1/flows").json()["flows"] == []
    assert stack.globex.get("/v1/flows/f").status_code == 404
    # the tenant owning it registers the same flow
    own = stack.acme.post("/v1/flows", json=http_flow("http://127.0.0.1:9/hook", "acme_key"))
    assert own.status_code == 201


def test_a_push_job_naming_a_shared_secret_runs_for_any_tenant(stack, monkeypatch):
    with FakeHttpPlatform(auth=f"Bearer {SHARED_KEY}") as platform:
        assert stack.globex.post("/v1/flows", json=http_flow(platform.url, "shared_key")).status_code == 201
        job_id = stack.globex.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
        run_push(stack, monkeypatch)
    job = stack.globex.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job
    assert len(platform.requests) == 2 and auths(platform) == {f"Bearer {SHARED_KEY}"}


def test_the_platform_gets_acmes_secret_only_for_acmes_job(stack, monkeypatch, registry):
    from gateway.ledger.flows import parse_flow

    with FakeHttpPlatform() as platform:
        assert stack.acme.post("/v1/flows", json=http_flow(platform.url, "acme_key", "a")).status_code == 201
        assert stack.acme.post("/v1/flows", json=http_flow(platform.url, "n8n_key", "b")).status_code == 201
        assert stack.globex.post("/v1/flows", json=http_flow(platform.url, "n8n_key", "b")).status_code == 201
        # a flow stored without the registration check (as flows registered before secrets had owners)
        registry.register("globex", parse_flow(http_flow(platform.url, "acme_key", "legacy")))
        acme_a = stack.acme.post("/v1/jobs", json={"flow_id": "a"}).json()["job_id"]
        run_push(stack, monkeypatch)
        acme_seen = [r.headers.get("Authorization") for r in platform.requests]
        platform.requests.clear()
        acme_b = stack.acme.post("/v1/jobs", json={"flow_id": "b"}).json()["job_id"]
        run_push(stack, monkeypatch)
        acme_b_seen = auths(platform)
        platform.requests.clear()
        globex_b = stack.globex.post("/v1/jobs", json={"flow_id": "b"}).json()["job_id"]
        run_push(stack, monkeypatch)
        globex_b_seen = auths(platform)
        platform.requests.clear()
        legacy = stack.globex.post("/v1/jobs", json={"flow_id": "legacy"}).json()["job_id"]
        run_push(stack, monkeypatch)
        legacy_seen = list(platform.requests)
    assert acme_seen == [f"Bearer {ACME_KEY}"] * 2
    assert acme_b_seen == {f"Bearer {ACME_OWN_N8N}"}  # a tenant's own entry wins over "*"
    assert globex_b_seen == {f"Bearer {SHARED_N8N}"}
    assert legacy_seen == []  # acme's secret never left for globex's job: the call failed first
    batch = stack.globex.get(f"/v1/jobs/{legacy}/batches/0").json()
    assert batch["status"] == "failed" and "not configured" in batch["error"]
    assert ACME_KEY not in batch["error"]
    for client, job_id in ((stack.acme, acme_a), (stack.acme, acme_b), (stack.globex, globex_b)):
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"


# -- credentials never in a child's environment ---------------------------------------------------


CREDENTIAL_VALUES = (TOKEN, OTHER_TOKEN, ACME_KEY, SHARED_KEY, SIGNING_KEY, "redispass-77aa")


def credential_env(monkeypatch, tmp_path: Path) -> Settings:
    """Settings built from an environment holding every kind of credential, as an operator might set it."""
    for name in list(os.environ):
        if name.upper().startswith("BATCHGATE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("BATCHGATE_TOKENS", json.dumps({TOKEN: "acme", OTHER_TOKEN: "globex"}))
    monkeypatch.setenv("BATCHGATE_SECRETS", json.dumps(SECRETS))
    monkeypatch.setenv("BATCHGATE_SIGNING_KEY", SIGNING_KEY)
    monkeypatch.setenv("BATCHGATE_QUEUE_REDIS_URL", "redis://:redispass-77aa@127.0.0.1:1/0")
    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)  # the CLI's own bearer token
    monkeypatch.setenv("BATCHGATE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("BATCHGATE_OUTBOUND_ALLOW", '["127.0.0.1/32"]')
    return Settings()


def test_child_env_passes_credentials_by_a_private_file_only(monkeypatch, tmp_path, redis_server):
    settings = credential_env(monkeypatch, tmp_path)
    env = procs.child_env(settings, redis_server.url, settings.token_map())
    for value in CREDENTIAL_VALUES:
        assert not [k for k, v in env.items() if value in v or value in k], value
    assert not set(env) & {"BATCHGATE_TOKENS", "BATCHGATE_SECRETS", "BATCHGATE_SIGNING_KEY",
                           "BATCHGATE_REDIS_URL", "BATCHGATE_QUEUE_REDIS_URL", "BATCHGATE_TOKEN"}
    path = Path(env["BATCHGATE_CONFIG_FILE"])
    assert path.parent == (tmp_path / "data").resolve()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # a child reads the same settings back
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = Settings()
    assert child.token_map() == settings.token_map()
    assert child.secret_for("acme", "acme_key") == ACME_KEY and child.secret_for("globex", "acme_key") is None
    assert child.signing_secret() == SIGNING_KEY.encode()
    assert child.redis_url.get_secret_value() == redis_server.url
    assert child.outbound_allow == ["127.0.0.1/32"]


def test_the_api_process_environment_holds_no_credential(monkeypatch, tmp_path, redis_server):
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    settings = credential_env(monkeypatch, tmp_path)
    env = procs.child_env(settings, redis_server.url, settings.token_map())
    port = free_port()
    api = procs.start_api(env, "127.0.0.1", port, workers=1)
    try:
        procs.wait_healthy(f"http://127.0.0.1:{port}", timeout_s=30, proc=api)
        client = ApiClient(f"http://127.0.0.1:{port}", TOKEN)
        assert client.get("/v1/flows").status_code == 200  # the token came from the file
        pids = [api.pid, *_children(api.pid)]
        assert len(pids) >= 2  # gunicorn's master and its worker
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"BATCHGATE_CONFIG_FILE=" in environ
            for value in CREDENTIAL_VALUES:
                assert value.encode() not in environ, (pid, value)
    finally:
        procs.stop(api)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_a_config_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "bg.json"
    path.write_text(json.dumps({"tokens": {TOKEN: "acme"}}))
    path.chmod(0o644)
    with pytest.raises(ValidationError) as caught:
        Settings(config_file=path)
    assert "chmod 600" in str(caught.value) and TOKEN not in str(caught.value)
    path.chmod(0o600)
    assert Settings(config_file=path).token_map() == {TOKEN: "acme"}
    path.write_text(json.dumps({"token": {TOKEN: "acme"}}))
    with pytest.raises(ValidationError, match="unknown settings: token"):
        Settings(config_file=path)
    path.write_text(json.dumps({"secrets": {"flat": TOKEN}}))
    with pytest.raises(ValidationError) as caught:
        Settings(config_file=path)
    assert "flat form" in str(caught.value) and TOKEN not in str(caught.value)


# -- no token in a log line ---------------------------------------------------------------------


def test_rq_jobs_and_worker_logs_carry_no_lease_token(stack, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with FakeHttpPlatform() as platform:
        flow = http_flow(platform.url, "acme_key", count=6)
        assert stack.acme.post("/v1/flows", json=flow).status_code == 201
        job_id = stack.acme.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
        run_push(stack, monkeypatch)
        # a poll is an RQ job whose arguments hold a lease token: its description must not
        spec = stack.ledger.spec(job_id)
        stack.dispatcher._schedule_poll(spec, spec.flow.stages[0], 0, 0, 1, "lease-tok-9f2c71", {"run": 1})
        queue = stack.dispatcher.queue
        descriptions = [queue.fetch_job(i).description for i in queue.scheduled_job_registry.get_job_ids()]
    tokens = committed_lease_tokens(stack, job_id, 3)
    assert len(tokens) == 3
    assert descriptions == [f"poll_stage {job_id} 0 0 1"]
    assert stack.acme.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    logged = caplog.text + "\n".join(descriptions)
    assert "stage" in caplog.text  # the calls were logged at DEBUG
    for secret in (*tokens, "lease-tok-9f2c71", ACME_KEY, SIGNING_KEY):
        assert secret not in logged


def test_batchgate_worker_reads_its_config_file_and_logs_no_token(stack, redis_server, tmp_path):
    """A real `batchgate worker` process, started as `up` starts it, at DEBUG."""
    with FakeHttpPlatform(auth=f"Bearer {ACME_KEY}") as platform:
        assert stack.acme.post("/v1/flows", json=http_flow(platform.url, "acme_key")).status_code == 201
        job_id = stack.acme.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
        env = procs.child_env(stack.settings, redis_server.url, stack.settings.token_map())
        env.update(BATCHGATE_LOG_LEVEL="DEBUG", BATCHGATE_PUBLIC_URL=stack.settings.base_url(),
                   BATCHGATE_OUTBOUND_ALLOW='["127.0.0.1/32"]')
        result = subprocess.run([sys.executable, "-m", "gateway.runtime.cli", "worker", "--burst"], env=env,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert auths(platform) == {f"Bearer {ACME_KEY}"}  # the secret came from the file
    assert stack.acme.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    tokens = committed_lease_tokens(stack, job_id, 2)
    assert len(tokens) == 2
    output = result.stdout + result.stderr
    assert f"job_id={job_id}" in output or job_id in output  # it did log its work
    for secret in (*tokens, ACME_KEY, SIGNING_KEY, TOKEN):
        assert secret not in output


def test_a_500_on_a_callback_url_logs_no_token(stack, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    assert stack.acme.post("/v1/flows", json=http_flow("http://127.0.0.1:9/hook", None,
                                                        mode="callback")).status_code == 201
    job_id = stack.acme.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
    token = sign({"j": job_id, "s": 0, "st": 0, "a": 1, "t": "lease-tok-51a9c3"},
                 stack.settings.signing_secret(), "callback", 60)

    def boom(*args, **kwargs):
        raise RuntimeError("commit exploded")

    monkeypatch.setattr(gateway.api.callbacks, "commit_answer", boom)
    resp = stack.acme.session.post(f"{stack.acme.base}/v1/callbacks/{token}",
                                   json={"status": "succeeded", "output": {}})
    assert resp.status_code == 500 and token not in resp.text
    # every line our code logged, tracebacks included; the dev server's own access log is left out
    # (production runs gunicorn without an access log)
    fmt = logging.Formatter("%(name)s %(levelname)s %(message)s")
    lines = "\n".join(fmt.format(r) for r in caplog.records if not r.name.startswith("werkzeug"))
    assert "commit exploded" in lines and "/v1/callbacks/" in lines
    body, mac = token.split(".")
    for secret in (body, mac, "lease-tok-51a9c3"):
        assert secret not in lines


def test_redact_path():
    assert redact_path("/v1/callbacks/abc.def").startswith("/v1/callbacks/<redacted:")
    assert "abc.def" not in redact_path("/v1/callbacks/abc.def")
    assert "tok" not in redact_path("/v1/blobs/tok")
    assert redact_path("/v1/jobs/job_1") == "/v1/jobs/job_1"


# -- flows are immutable for good -----------------------------------------------------------------


def test_a_deleted_flow_version_is_a_tombstone(stack):
    api = stack.acme
    first = http_flow("http://127.0.0.1:9/hook", None, mode="callback", count=2)
    other = {**first, "description": "other content under the old label"}
    assert api.post("/v1/flows", json=first).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
    assert api.post(f"/v1/jobs/{job_id}/pause", json={}).status_code == 200
    assert api.delete("/v1/flows/f/versions/1").status_code == 204
    for body in (other, first):  # other content, and even the same content: retired for good
        resp = api.post("/v1/flows", json=body)
        assert resp.status_code == 409 and resp.json()["type"].endswith("flow-retired"), resp.text
    assert api.get("/v1/flows/f/versions/1").status_code == 404
    assert api.get("/v1/flows").json()["flows"] == []
    assert api.post("/v1/jobs", json={"flow_id": "f", "flow_version": "1"}).status_code == 404
    resumed = api.post(f"/v1/jobs/{job_id}/resume", json={})
    assert resumed.status_code == 409 and resumed.json()["type"].endswith("flow-version-mismatch")
    assert api.delete("/v1/flows/f/versions/1").status_code == 404
    assert api.post("/v1/flows", json={**other, "version": "2"}).status_code == 201  # a new version is fine
    # another tenant's namespace is its own
    assert stack.globex.post("/v1/flows", json=other).status_code == 201


# -- strict tokens ------------------------------------------------------------------------------


KEY = b"k" * 32
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _flip_trailing_bits(part: str) -> str:
    """The same bytes spelled with non-zero trailing bits (unused bits of the last character)."""
    unused = {2: 4, 3: 2}[len(part) % 4]  # 43-char MACs: 2 unused bits
    last = ALPHABET.index(part[-1])
    return part[:-1] + ALPHABET[last ^ ((1 << unused) - 1)]


def non_canonical(token: str) -> list[str]:
    body, mac = token.split(".")
    variants = [f"{body}.{mac}=", f"{body}=.{mac}", f"{body}.{_flip_trailing_bits(mac)}",
                f"{body}.{mac} ", f" {body}.{mac}", f"{body}.{mac}.", f"{body}..{mac}", f"{body}.",
                f".{mac}", f"{body}.{mac}\n", f"{body}.{mac[:-1]}", f"{body}.{mac}A"]
    if len(body) % 4:
        variants.append(f"{_flip_trailing_bits(body)}.{mac}")
    if "-" in mac or "_" in mac:
        variants.append(f"{body}.{mac.replace('-', '+').replace('_', '/')}")
    return variants


def a_token_with_url_safe_characters(purpose: str, key: bytes = KEY, **payload) -> str:
    for n in range(1000):
        token = sign({**payload, "n": n}, key, purpose, 60)
        if "-" in token.split(".")[1]:
            return token
    raise AssertionError("no token with '-' in its MAC")


def test_only_the_canonical_spelling_of_a_token_verifies():
    token = a_token_with_url_safe_characters("callback", j="job_x", s=0, st=0, a=1, t="lease")
    assert verify(token, KEY, "callback")["j"] == "job_x"
    from gateway.errors import Unauthorized

    for variant in non_canonical(token):
        assert variant != token
        with pytest.raises(Unauthorized):
            verify(variant, KEY, "callback")
    with pytest.raises(Unauthorized):  # purpose-bound
        verify(token, KEY, "blob")


def test_non_canonical_tokens_get_401_from_the_api(stack):
    api = stack.acme
    key = stack.settings.signing_secret()
    flow = http_flow("http://127.0.0.1:9/hook", None, mode="callback")
    assert api.post("/v1/flows", json=flow).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
    callback = a_token_with_url_safe_characters("callback", key, j=job_id, s=0, st=0, a=1, t="stale-token")
    blob = a_token_with_url_safe_characters("blob", key, j=job_id, s=0)
    answer = {"status": "succeeded", "output": {}}
    genuine = api.session.post(f"{api.base}/v1/callbacks/{callback}", json=answer)
    assert genuine.status_code in (404, 409), genuine.text  # past the signature: no such lease
    assert api.session.get(f"{api.base}/v1/blobs/{blob}").status_code in (200, 404)
    for variant in non_canonical(callback):
        if "/" in variant or variant.strip() != variant or not variant:
            continue  # not a single URL path segment
        resp = api.session.post(f"{api.base}/v1/callbacks/{variant}", json=answer)
        assert resp.status_code == 401, (variant, resp.status_code)
    for variant in non_canonical(blob):
        if "/" in variant or variant.strip() != variant:
            continue
        assert api.session.get(f"{api.base}/v1/blobs/{variant}").status_code == 401, variant


def test_a_stage_call_prints_no_secret_or_signing_key():
    from connectors.base import StageCall

    call = StageCall(envelope={"idempotency_key": "j:0:s"}, target={"type": "http"},
                     secrets={"auth_secret": "sk-very-secret"}, signing_key=b"signing-key-bytes")
    shown = repr(call) + str(call)
    assert "sk-very-secret" not in shown and "signing-key-bytes" not in shown
