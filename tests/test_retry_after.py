"""Retry-After is read one way everywhere: the platforms' answers (connectors) and the sources' (chunker).

An HTTP date is always GMT (RFC 9110 5.6.7), whatever the local time zone; "-0000" says so too. The
connectors used to read a date without an explicit zone as local time: on a machine in UTC+8 a wait of
30 s became 0 s or eight hours.
"""

from __future__ import annotations

import os
import time
from email.utils import formatdate

import pytest
import requests

from chunker.httputil import retry_after_seconds
from connectors.base import retry_after_s


def connectors_read(value: str | None) -> float | None:
    resp = requests.Response()
    if value is not None:
        resp.headers["Retry-After"] = value
    return retry_after_s(resp)


@pytest.fixture(params=["UTC", "Asia/Shanghai", "America/Los_Angeles"])
def local_zone(request, monkeypatch):
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("read", [connectors_read, retry_after_seconds], ids=["connectors", "chunker"])
def test_retry_after_in_seconds_or_as_an_http_date_in_any_local_zone(read, local_zone):
    assert read("7") == 7.0
    assert read(" 12 ") == 12.0
    in_30s = time.time() + 30
    assert 25 <= read(formatdate(in_30s, usegmt=True)) <= 31  # "..., 02 Dec 2026 08:30:00 GMT"
    assert 25 <= read(formatdate(in_30s).replace("+0000", "-0000")) <= 31  # no zone said: still GMT
    assert read(formatdate(time.time() - 60, usegmt=True)) == 0.0  # in the past: no wait
    for bad in (None, "", "soon", "-5", "1e9x"):
        assert read(bad) is None, bad
    assert os.environ["TZ"] == local_zone
