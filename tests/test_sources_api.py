"""Sources fail fast and files report progress by bytes, seen through the HTTP API.

Creating a job reads (and drops) the source's first batch: a missing file, rows that do not parse or a URL
that answers 4xx are a 422 and no job; a source that cannot be reached right now is a 503 with Retry-After.
Jobs over jsonl/csv files record the file's size and report progress and ETA from the committed byte offset.
"""

from __future__ import annotations

import json

import pytest

from gateway.runtime.cli_client import _measure
from gateway.ledger.jobspec import JobSpec
from tests.chunker.helpers import Server, file_app

PROBLEM = "application/problem+json"


@pytest.fixture
def settings(settings):
    """The sources here are servers on 127.0.0.1, which the outbound guard admits only when allowed."""
    return settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})


@pytest.fixture
def serve():
    """Starts local HTTP servers on 127.0.0.1 (see tests/chunker/helpers.py) and stops them after."""
    servers: list[Server] = []

    def start(app) -> Server:
        servers.append(Server(app))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def register(api, flow_id="src", max_items=3, stages=("s",), source=None) -> None:
    flow = {"id": flow_id, "version": "1", "stages": [{"name": s} for s in stages],
            "batching": {"max_items": max_items}}
    if source is not None:
        flow["source"] = source
    resp = api.post("/v1/flows", json=flow)
    assert resp.status_code == 201, resp.text


def start_job(api, source, flow_id="src", **headers):
    return api.post("/v1/jobs", json={"flow_id": flow_id, "source": source}, headers=headers)


def assert_refused(api, resp, status) -> str:
    """A problem answer with ``status`` and no job left behind; returns its detail."""
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].split(";")[0] == PROBLEM
    body = resp.json()
    assert body["status"] == status
    assert api.get("/v1/jobs").json() == {"jobs": []}
    return body["detail"]


def answer(status: int, headers: dict | None = None, body: bytes = b""):
    return lambda path, query, request_headers: (status, headers or {}, body)


# -- fail fast -------------------------------------------------------------------------------------

def test_missing_csv_path_is_422_naming_the_file_and_creates_no_job(api, tmp_path):
    register(api)
    missing = tmp_path / "nonexistent.csv"
    detail = assert_refused(api, start_job(api, {"type": "csv", "path": str(missing)}), 422)
    assert str(missing) in detail and "No such file" in detail and "cannot be read" in detail


def test_a_directory_is_not_a_csv_file(api, tmp_path):
    register(api)
    detail = assert_refused(api, start_job(api, {"type": "csv", "path": str(tmp_path)}), 422)
    assert "directory" in detail.lower()


@pytest.mark.parametrize("body,problem", [
    (b"id,name\n1,ann\n2,bob,extra\n", "row has 3 fields but the header has 2"),
    (b"id,id\n1,2\n", "duplicate column names"),
    (b"id,name\n1,\xff\xfe\n", "invalid CSV"),
])
def test_csv_whose_first_rows_do_not_parse_is_422(api, tmp_path, body, problem):
    register(api)
    path = tmp_path / "bad.csv"
    path.write_bytes(body)
    detail = assert_refused(api, start_job(api, {"type": "csv", "path": str(path)}), 422)
    assert problem in detail and "line" in detail


def test_jsonl_with_a_bad_first_line_is_422(api, tmp_path):
    register(api)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\nnot json\n')
    detail = assert_refused(api, start_job(api, {"type": "jsonl", "path": str(path)}), 422)
    assert "invalid JSON" in detail and "line 2" in detail


def test_only_the_first_batch_is_read_at_creation(api, tmp_path):
    register(api, max_items=2)
    path = tmp_path / "late.csv"
    path.write_text("id\n1\n2\n3\n\"unterminated\n")  # the third row is broken, past batch 0
    resp = start_job(api, {"type": "csv", "path": str(path)})
    assert resp.status_code == 201, resp.text
    assert resp.json()["batches"]["planned"] == 0  # nothing kept: planning stays lazy


@pytest.mark.parametrize("source", [
    {"type": "http_json", "url": "{base}/missing"},
    {"type": "http_json", "url": "{base}/missing", "pagination": {"style": "page"}},
    {"type": "csv", "url": "{base}/missing.csv"},
    {"type": "jsonl", "url": "{base}/missing.jsonl"},
])
def test_url_answering_404_is_422(api, serve, source):
    server = serve(answer(404, body=b"not found"))
    register(api)
    source = {**source, "url": source["url"].format(base=server.url)}
    detail = assert_refused(api, start_job(api, source), 422)
    assert "HTTP 404" in detail and server.url in detail
    assert len(server.log) == 1  # one request, no retries


def test_http_json_whose_first_page_does_not_parse_is_422(api, serve):
    server = serve(answer(200, {"Content-Type": "application/json"}, b'{"results": []}'))
    register(api)
    detail = assert_refused(api, start_job(api, {"type": "http_json", "url": server.url}), 422)
    assert "items field 'data' missing" in detail


def test_unreachable_source_is_503_with_retry_after_and_the_key_is_not_spent(api, serve):
    """A 4xx would be replayed for the Idempotency-Key's 24 h; a 503 lets the same request retry."""
    calls = []

    def flaky(path, query, headers):
        calls.append(path)
        if len(calls) == 1:
            return 503, {"Retry-After": "7"}, b"down for maintenance"
        return 200, {"Content-Type": "application/json"}, json.dumps({"data": [1, 2]}).encode()

    server = serve(flaky)
    register(api)
    source = {"type": "http_json", "url": f"{server.url}/items"}
    resp = start_job(api, source, **{"Idempotency-Key": "k1"})
    detail = assert_refused(api, resp, 503)
    assert resp.headers["Retry-After"] == "7"
    assert "could not be reached" in detail and "HTTP 503" in detail and "try again later" in detail
    again = start_job(api, source, **{"Idempotency-Key": "k1"})
    assert again.status_code == 201, again.text
    assert "Idempotent-Replayed" not in again.headers


def test_connection_refused_is_503_saying_the_source_could_not_be_reached(api, serve):
    server = serve(answer(200))
    dead = server.url
    server.close()
    register(api)
    resp = start_job(api, {"type": "jsonl", "url": f"{dead}/items.jsonl"})
    detail = assert_refused(api, resp, 503)
    assert "could not be reached" in detail and "ConnectionError" in detail
    assert resp.headers["Retry-After"] == "5"


def test_external_inline_and_sequence_sources_are_not_read(api):
    api.post("/v1/flows", json={"id": "ext", "version": "1",
                                "stages": [{"name": "fetch", "fetches": True}, {"name": "s"}]})
    assert start_job(api, {"type": "external", "start": {"page": 1}}, flow_id="ext").status_code == 201
    register(api)
    assert start_job(api, {"type": "inline", "items": [1, 2]}).status_code == 201
    view = start_job(api, {"type": "sequence", "count": 5}).json()
    assert view["items_total"] == 5 and view["bytes_total"] is None and view["bytes_done"] is None


# -- progress by bytes -----------------------------------------------------------------------------

def run_batches(api, job_id):
    """Lease and complete every batch one by one; yields the job view after each completion."""
    while (resp := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        env = resp.json()
        done = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                        json={"lease_token": env["lease_token"], "output": {"n": len(env["items"])}})
        assert done.status_code == 200, done.text
        yield api.get(f"/v1/jobs/{job_id}").json()
    assert resp.status_code == 204, resp.text


def test_csv_file_job_reports_progress_and_eta_by_bytes(api, tmp_path):
    register(api, max_items=3)
    path = tmp_path / "people.csv"
    path.write_text("id,name\n" + "".join(f"{i},person number {i}\n" for i in range(10)))
    created = start_job(api, {"type": "csv", "path": str(path)})
    assert created.status_code == 201, created.text
    view = created.json()
    size = path.stat().st_size
    assert view["bytes_total"] == size and view["bytes_done"] == 0
    assert view["items_total"] is None and view["progress"] == 0.0 and view["eta_s"] is None

    views = list(run_batches(api, view["job_id"]))
    assert len(views) == 4
    fractions = [v["progress"] for v in views]
    assert all(0 < f < 1 for f in fractions[:-1]) and fractions == sorted(set(fractions))
    assert [v["bytes_done"] for v in views] == sorted({v["bytes_done"] for v in views})
    for v in views[:-1]:
        assert v["status"] == "running" and v["eta_s"] is not None and v["eta_s"] >= 0
        assert v["progress"] == round(v["bytes_done"] / size, 4)
    final = views[-1]
    assert final["status"] == "succeeded" and final["progress"] == 1.0 and final["eta_s"] == 0.0
    # read to the end, the file's item count is known (issue 17: it stayed null)
    assert final["bytes_done"] == size and final["items_done"] == 10 and final["items_total"] == 10
    assert all(v["items_total"] is None for v in views if not v["source_exhausted"])
    # the CLI's bar: bytes of the file while the count is unknown, then items
    unknown = {**final, "items_total": None, "bytes_done": size // 2, "items_done": 5}  # halfway
    assert _measure(unknown) == (size, size // 2, "B")
    assert _measure(final) == (size, size, "B")  # one unit for the whole run: no jump at the end
    assert _measure({**final, "bytes_total": None}) == (10, 10, "items")
    # one slow batch holds the committed cursor at byte 0 while 6 of the 10 planned items are done: the
    # bar follows the items done over the bytes the planner has cut, not the stalled cursor
    stalled = {**final, "items_total": None, "bytes_done": 0, "bytes_read": size, "items_planned": 10,
               "items_done": 6}
    assert _measure(stalled) == (size, int(size * 0.6), "B")
    assert final["bytes_read"] == size and final["items_planned"] == 10


def test_jsonl_url_job_takes_its_size_from_content_length(api, serve):
    body = b"".join(json.dumps({"n": i}).encode() + b"\n" for i in range(5))
    server = serve(file_app(body, honour_range=True))
    register(api, max_items=2)
    view = start_job(api, {"type": "jsonl", "url": f"{server.url}/items.jsonl"}).json()
    assert view["bytes_total"] == len(body) and view["progress"] == 0.0
    views = list(run_batches(api, view["job_id"]))
    assert [v["bytes_done"] for v in views] == [len(body) * 2 // 5, len(body) * 4 // 5, len(body)]
    assert views[-1]["progress"] == 1.0 and views[-1]["status"] == "succeeded"


def test_specs_written_before_total_bytes_still_load():
    fields = {"job_id": "job_1", "tenant": "acme", "flow_hash": "h", "params": "{}", "total_hint": "",
              "source": json.dumps({"type": "csv", "path": "/x.csv", "delimiter": ",", "header": True}),
              "flow": json.dumps({"id": "f", "version": "1", "stages": [{"name": "s"}]})}
    spec = JobSpec.from_fields(fields)
    assert spec.total_bytes is None
    assert JobSpec.from_fields({**fields, **spec.to_fields()}) == spec
