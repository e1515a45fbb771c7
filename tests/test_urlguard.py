"""Outbound URL guard: only public http(s) addresses, unless allowed."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from gateway.net.urlguard import Allowlist, UnsafeURL, check_url, forbidden, numeric_host

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
    answers = {"evil.example": "169.254.169.254", "internal.example": "10.0.0.1",
               "public.example": "93.184.216.34"}

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


# -- every refused range and spelling -------------------------------------------------------------------

REFUSED_HOSTS = [
    "100.64.0.1", "100.127.255.254",                         # shared address space (CGNAT)
    "[2002:7f00:1::]", "[2002:a00:1::]",                     # 6to4 wrapping loopback, private
    "[64:ff9b::7f00:1]", "[64:ff9b::a9fe:a9fe]",             # NAT64 wrapping loopback, metadata
    "[64:ff9b:1::1]",                                        # local-use NAT64
    "[2001:0:4136:e378:8000:63bf:80ff:fffe]",                # Teredo, client 127.0.0.1
    "[::ffff:127.0.0.1]", "[::ffff:10.1.2.3]", "[::127.0.0.1]",
    "0.0.0.0", "[::]",
    "2130706433", "0x7f000001", "0177.0.0.1", "127.1", "0x7f.1", "017700000001", "127.0.0.1.",
    "[::1]", "169.254.169.254", "2852039166",                # metadata, also as a decimal
    "[fd00::1]", "[fe80::1]", "224.0.0.1", "[ff02::1]", "240.0.0.1", "255.255.255.255",
    "192.0.2.1", "198.18.0.1",                               # documentation, benchmarking
]


@pytest.mark.parametrize("host", REFUSED_HOSTS)
def test_refuses_every_non_public_range_and_spelling(host):
    with pytest.raises(UnsafeURL, match="BATCHGATE_OUTBOUND_ALLOW"):
        check_url(f"http://{host}:8080/x", NOTHING)


@pytest.mark.parametrize("host", ["2130706433", "0x7f000001", "0177.0.0.1", "127.1", "0x7f.1", "2852039166"])
def test_numeric_spellings_are_refused_by_what_they_stand_for_before_any_lookup(host, monkeypatch):
    """Even a resolver that would answer a public address does not get asked."""
    asked = []

    def public_resolver(name, port, *args, **kwargs):
        asked.append(name)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]

    monkeypatch.setattr(socket, "getaddrinfo", public_resolver)
    with pytest.raises(UnsafeURL, match=r"is (127\.0\.0\.1|169\.254\.169\.254)"):
        check_url(f"http://{host}/", NOTHING)
    assert asked == []


def test_numeric_host_reads_what_inet_aton_reads():
    assert numeric_host("2130706433") == ipaddress.ip_address("127.0.0.1")
    assert numeric_host("0x7f.0.0.1") == ipaddress.ip_address("127.0.0.1")
    assert numeric_host("0177.1") == ipaddress.ip_address("127.0.0.1")
    assert numeric_host("[::1]") == ipaddress.ip_address("::1")
    assert numeric_host("example.com") is None and numeric_host("cafe.face") is None


@pytest.mark.parametrize("address, why", [
    ("100.64.0.1", "CGNAT"), ("2002:7f00:1::", "loopback address (127.0.0.1) wrapped in a 6to4"),
    ("64:ff9b::7f00:1", "loopback address (127.0.0.1) behind the NAT64"), ("64:ff9b:1::1", "NAT64"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "wrapped in a Teredo"), ("::ffff:127.0.0.1", "loopback"),
    ("0.0.0.0", "unspecified"), ("::1", "loopback"), ("169.254.169.254", "metadata"),
    ("fd00::1", "private"), ("224.0.0.1", "multicast"), ("240.0.0.1", "reserved"),
    ("169.254.1.1", "link-local"), ("10.0.0.1", "private"),
])
def test_forbidden_says_why(address, why):
    assert why in (forbidden(ipaddress.ip_address(address)) or "")


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700::1111", "::ffff:93.184.216.34",
                                     "2002:5db8:d822::1", "64:ff9b::5db8:d822"])
def test_public_addresses_and_their_wrapped_forms_pass(address):
    assert forbidden(ipaddress.ip_address(address)) is None
    check_url(f"http://[{address}]/" if ":" in address else f"http://{address}/", NOTHING)


def test_every_address_a_name_resolves_to_is_checked(monkeypatch):
    def two_answers(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", two_answers)
    with pytest.raises(UnsafeURL, match="resolves to 10.0.0.1, a private address"):
        check_url("https://mixed.example/", NOTHING)


def test_allowed_networks_cover_other_spellings_of_their_addresses():
    allow = Allowlist.parse(["127.0.0.1/32"])
    for host in ("127.0.0.1", "2130706433", "127.1", "[::ffff:127.0.0.1]"):
        check_url(f"http://{host}:5678/", allow)
    with pytest.raises(UnsafeURL):
        check_url("http://127.0.0.2:5678/", allow)


# -- registration: what the URL itself shows, nothing resolved (issue 17: a Dify flow offline) ---------

def test_registration_checks_refuse_what_the_url_shows_and_resolve_nothing(monkeypatch):
    from gateway.net.urlguard import check_url_shape

    def no_dns(*args, **kwargs):
        raise AssertionError("check_url_shape must not resolve")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    for url in ("https://api.dify.ai/v1", "https://does-not-resolve.invalid/hook", "http://[2606:4700::1111]/"):
        check_url_shape(url, NOTHING)
    for url, says in (("http://10.0.0.1/hook", "a private address"), ("http://169.254.169.254/", "metadata"),
                      ("http://0x7f000001:5678/", "loopback"), ("http://localhost:5678/", "names this machine"),
                      ("http://n8n.localhost/", "names this machine"), ("ftp://example.com/", "http")):
        with pytest.raises(UnsafeURL, match=says):
            check_url_shape(url, NOTHING)
    allow = Allowlist.parse(["127.0.0.1/32", "localhost"])
    check_url_shape("http://127.0.0.1:5678/", allow)
    check_url_shape("http://localhost:5678/", allow)


def test_a_flow_on_a_host_that_does_not_resolve_here_registers_and_its_calls_are_still_guarded(
        api, monkeypatch):
    """The shipped Dify flow registered offline answered 422 (api.dify.ai did not resolve); now it
    registers, and a call to a name that resolves to a private address is still refused on connection."""
    flow = {"id": "dify-offline", "version": "1", "source": {"type": "sequence", "count": 2},
            "stages": [{"name": "s", "target": {"type": "http", "url": "https://unreachable.invalid/run",
                                                 "mode": "sync"}}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    bad = {**flow, "version": "2",
           "stages": [{"name": "s", "target": {"type": "http", "url": "http://192.168.1.5/run", "mode": "sync"}}]}
    refused = api.post("/v1/flows", json=bad)
    assert refused.status_code == 422 and "private address" in refused.json()["detail"]
    answers = {"internal.example": "10.0.0.1"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))])
    with pytest.raises(UnsafeURL, match="resolves to 10.0.0.1"):
        check_url("http://internal.example/run", NOTHING)  # what each call goes through
