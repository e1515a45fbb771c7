"""Shared test data for connector tests: an envelope, calls, and assertions on errors and signatures."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from connectors.base import PlatformError, Retry, StageCall, verify_signature

SIGNING_KEY = b"test-signing-key"
DIFY_KEY = "app-s3cretDifyKey0001"
COZE_TOKEN = "pat_s3cretCozeToken0001"
N8N_API_KEY = "n8n-s3cret-api-key-0001"
HOOK_SECRET = "hook-s3cret-0001"


def envelope(items: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A stage envelope as the gateway sends it."""
    items = [{"id": 1}, {"id": 2}, {"id": 3}] if items is None else items
    return {"job_id": "job_1", "seq": 4, "stage": "score", "attempt": 2,
            "idempotency_key": "job_1:4:score:2", "cursor": {"offset": 9}, "items": items, "items_url": None,
            "input": None, "params": {"title": "Data engineer"}, "callback_url": "https://gw.example/cb/x",
            **extra}


def call(target: dict[str, Any], secrets: dict[str, str] | None = None, timeout_s: float = 5.0,
         on_progress: Callable[[], None] | None = None, **env: Any) -> StageCall:
    """A StageCall for ``target``, signed with ``SIGNING_KEY``."""
    return StageCall(envelope(**env), target, secrets=secrets or {}, timeout_s=timeout_s,
                     signing_key=SIGNING_KEY, on_progress=on_progress)


def raises(retry: Retry, fn: Callable[[], Any], *secrets: str) -> PlatformError:
    """Run ``fn``, expect a PlatformError of class ``retry`` whose message holds none of ``secrets``."""
    with pytest.raises(PlatformError) as info:
        fn()
    err = info.value
    assert err.retry is retry, f"{err.retry} != {retry}: {err.message}"
    for secret in secrets:
        assert secret not in err.message
    assert len(err.message) < 800
    return err


def assert_signed(headers: Any, body: bytes | None, stage_call: StageCall) -> None:
    """The request carries the call's idempotency key and a signature over its exact body."""
    assert headers["Idempotency-Key"] == stage_call.idempotency_key
    assert headers["Batchgate-Job-Id"] == "job_1"
    assert headers["Batchgate-Seq"] == "4"
    assert headers["Batchgate-Stage"] == "score"
    assert headers["Batchgate-Attempt"] == "2"
    assert verify_signature(headers["Batchgate-Signature"], body or b"", SIGNING_KEY)
    assert not verify_signature(headers["Batchgate-Signature"], (body or b"") + b" ", SIGNING_KEY)


def sent_json(body: bytes | None) -> Any:
    return json.loads(body) if body else None
