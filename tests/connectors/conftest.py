"""Fixtures for connector tests: an HTTP session, and a `responses` mock for unit tests."""

from __future__ import annotations

import pytest
import requests
import responses as responses_lib


@pytest.fixture
def session():
    with requests.Session() as s:
        yield s


@pytest.fixture
def mock():
    """A strict `responses` mock: every registered response must be used."""
    with responses_lib.RequestsMock(assert_all_requests_are_fired=True) as rsps:
        yield rsps
