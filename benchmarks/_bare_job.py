"""The baseline's RQ job: the same HTTP call a push stage makes, with no ledger."""

from __future__ import annotations

import requests

_SESSION = requests.Session()


def call(url: str, envelope: dict) -> None:
    resp = _SESSION.post(url, json=envelope, timeout=30)
    resp.raise_for_status()
    resp.json()
