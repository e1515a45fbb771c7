"""Outbound URL guard: only public http(s) addresses, unless allowed."""

from __future__ import annotations

import socket

import pytest

from gateway.urlguard import Allowlist, UnsafeURL, check_url

NOTHING = Allowlist()


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/hook", "http://localhost:5678/webhook/x", "http://10.0.0.1/", "http://192.168.1.20/",
    "http://172.16.5.4/", "http://169.254.169.254/latest/meta-data/", "http://[::1]/", "http://0.0.0.0/",
    "http://[::ffff:127.0.0.1]/", "http://[fd00:ec2::254]/",
])
def test_refuses_non_public_addresses(url):
    with pytest.raises(UnsafeURL):
        check_url(url, NOTHING)


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "gopher://x", "//nohost", "http://"])
def test_refuses_other_schemes_and_missing_hosts(url):
    with pytest.raises(UnsafeURL):
        check_url(url, NOTHING)


def test_refuses_a_hostname_that_resolves_to_a_forbidden_address(monkeypatch):
    answers = {"evil.example": "169.254.169.254", "internal.example": "10.0.0.1", "public.example": "93.184.216.34"}

    def fake_getaddrinfo(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    for host in ("evil.example", "internal.example"):
        with pytest.raises(UnsafeURL, match="resolves to"):
            check_url(f"https://{host}/hook", NOTHING)
    check_url("https://public.example/hook", NOTHING)


def test_allowlist_admits_networks_and_hosts():
    allow = Allowlist.parse(["127.0.0.1/32", "n8n.internal"])
    check_url("http://127.0.0.1:5678/webhook/score", allow)
    check_url("http://n8n.internal/webhook/score", allow)
    with pytest.raises(UnsafeURL):
        check_url("http://10.0.0.1/", allow)


def test_public_address_passes():
    check_url("https://93.184.216.34/hook", NOTHING)
