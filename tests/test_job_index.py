"""The job index (gateway/ledger/jobindex.py, joblist.py): every path that changes a job's status files it
again; listings filter, order and page with an opaque cursor; lost index updates heal (verify on read,
the supervisor's pass, rebuild); Redis restarted from its AOF keeps the index.

``assert_indexed`` compares the raw index sets with a brute-force reading of every job record (it never
goes through the listing, which repairs what it reads and would hide a missed update).
"""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlparse

import pytest

from gateway.ledger.embedded import EmbeddedRedis, client_for
from gateway.ledger.flows import FlowRegistry, parse_flow
from gateway.ledger.jobindex import STATUSES, Filed, member
from gateway.ledger.joblist import ListQuery
from gateway.ledger.jobs import JobRequest, JobService, ResumeRequest
from gateway.ledger.ledger import Ledger
from gateway.ledger.migrate import migrate
from gateway.push.supervisor import Supervisor, recover_jobs
from gateway.settings import Settings

PROBLEM = "application/problem+json"


# -- brute force -----------------------------------------------------------------------------------

def truth(ledger: Ledger, tenant: str) -> dict[str, Filed]:
    """Every job of ``tenant`` with a record, read from the records themselves."""
    out = {}
    for job_id in ledger.r.zrange(ledger.keys.jobs(tenant), 0, -1):
        job = ledger.r.hgetall(ledger.keys.job(job_id).job)
        if job:
            spec = ledger.spec(job_id)
            out[job_id] = Filed(job["status"], spec.flow.id, spec.flow.version, int(job["created_ms"]))
    return out


def assert_indexed(ledger: Ledger, tenant: str = "acme") -> None:
    expected: dict[str, set[str]] = {}
    meta = {}
    for job_id, f in truth(ledger, tenant).items():
        meta[job_id] = f.encode()
        for key in ledger.index.keys_of(tenant, f):
            expected.setdefault(key, set()).add(member(f.created_ms, job_id))
    actual = {}
    for key in ledger.r.scan_iter(ledger.keys.job_index_pattern(tenant)):
        if key != ledger.keys.job_index_meta(tenant) and ledger.r.zcard(key):
            actual[key] = set(ledger.r.zrange(key, 0, -1))
    assert actual == expected
    assert ledger.r.hgetall(ledger.keys.job_index_meta(tenant)) == meta


def brute_list(ledger: Ledger, tenant: str, q: ListQuery) -> list[str]:
    rows = [(f.created_ms, job_id) for job_id, f in truth(ledger, tenant).items()
            if q.status in (None, f.status) and q.flow_id in (None, f.flow_id)
            and q.flow_version in (None, f.flow_version)
            and (q.created_after is None or f.created_ms >= q.created_after)
            and (q.created_before is None or f.created_ms < q.created_before)]
    return [job_id for _, job_id in sorted(rows, reverse=q.order == "newest")]


def listed(jobs: JobService, tenant: str, **query) -> list[str]:
    """Every job a listing returns, following the cursor page by page."""
    q = ListQuery.model_validate(query)
    out = []
    while True:
        page = jobs.list(tenant, q)
        out += [v["job_id"] for v in page.jobs]
        if page.next_cursor is None:
            return out
        q = q.model_copy(update={"cursor": page.next_cursor})


# -- fixtures --------------------------------------------------------------------------------------

def flow(flow_id="f", version="1", count=4, stages=({"name": "score"}, {"name": "store"}), **extra) -> dict:
    return {"id": flow_id, "version": version, "stages": list(stages),
            "batching": {"max_items": 2}, "source": {"type": "sequence", "count": count}, **extra}


@pytest.fixture
def flows(registry):
    for fid, version in (("f", "1"), ("f", "2"), ("g", "1")):
        registry.register("acme", parse_flow(flow(fid, version)))
    registry.register("acme", parse_flow(flow("fragile", "1", count=2, stages=[
        {"name": "only", "retry": {"maximum_attempts": 1, "initial_interval": 0.01}}],
        tolerated_failure_percentage=0)))
    return registry


def create(jobs: JobService, flow_id="f", version=None) -> str:
    return jobs.create("acme", JobRequest(flow_id=flow_id, flow_version=version))["job_id"]


def created_in_order(jobs: JobService, *flows: tuple[str, str | None]) -> list[str]:
    """Jobs made one after another in distinct milliseconds: newest-first listings order by creation
    time, and two jobs of the same millisecond order by their ids' random part (a CI run made two of
    three in one millisecond, and the expected order was a coin toss)."""
    ids = []
    for flow_id, version in flows:
        ids.append(create(jobs, flow_id, version))
        time.sleep(0.002)
    return ids


# -- listing ---------------------------------------------------------------------------------------

def test_filters_combine_order_and_page_through_the_api(api, ledger, jobs, flows):
    ids = []
    for i in range(12):
        ids.append(create(jobs, ("f", "g")[i % 2], "2" if i % 3 == 0 and i % 2 == 0 else None))
        time.sleep(0.003)  # distinct creation times for the window filters
    for job_id in ids[::3]:
        ledger.pause(job_id, "t")
    ledger.cancel(ids[4], "t")
    created = [truth(ledger, "acme")[j].created_ms for j in ids]
    window = {"created_after": created[2], "created_before": created[9]}
    iso = {"created_after": datetime.fromtimestamp(created[2] / 1000, UTC).isoformat(),
           "created_before": created[9]}
    cases = [{}, {"status": "paused"}, {"status": "cancelled"}, {"status": "held"}, {"flow_id": "f"},
             {"flow_id": "f", "flow_version": "2"}, window, iso, {"status": "running", "flow_id": "g", **window},
             {"status": "paused", "flow_id": "f", "flow_version": "1", "order": "oldest"}, {"order": "oldest"}]
    for case in cases:
        expected = brute_list(ledger, "acme", ListQuery.model_validate(case))
        got, url, pages = [], "/v1/jobs?" + "&".join(f"{k}={v}" for k, v in case.items()) + "&limit=2", 0
        url = url.replace("+", "%2B")
        while url:
            resp = api.get(url)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            got += [j["job_id"] for j in body["jobs"]]
            url, pages = body.get("next"), pages + 1
            if url:
                assert resp.headers["Link"] == f'<{url}>; rel="next"'
                assert parse_qs(urlparse(url).query)["limit"] == ["2"]
            else:
                assert "Link" not in resp.headers and set(body) == {"jobs"}
        assert got == expected, case
        assert pages >= len(expected) // 2
    assert [j["job_id"] for j in api.get("/v1/jobs", params={"limit": 3}).json()["jobs"]] == ids[::-1][:3]


def test_bad_cursors_and_filters_are_422_problems(api, jobs, flows):
    for _ in range(3):
        create(jobs)
    first = api.get("/v1/jobs", params={"limit": 1, "status": "running"}).json()
    first["next_cursor"] = parse_qs(urlparse(first["next"]).query)["cursor"][0]
    bad = [{"cursor": "!!!"}, {"cursor": "bm90IGEgY3Vyc29y"}, {"cursor": "x" * 500},
           {"cursor": first["next_cursor"]},  # made for status=running
           {"cursor": first["next_cursor"], "status": "running", "order": "oldest"},
           {"status": "bogus"}, {"flow_version": "1"}, {"flow_id": "a:b"}, {"created_after": "yesterday"},
           {"created_after": 5, "created_before": 5}, {"created_before": "-3"}, {"limit": 0},
           {"limit": "many"}, {"created_after": "9" * 30}]
    for params in bad:
        resp = api.get("/v1/jobs", params=params)
        assert resp.status_code == 422, (params, resp.text)
        assert resp.headers["Content-Type"].startswith(PROBLEM) and resp.json()["detail"]
    ok = api.get("/v1/jobs", params={"limit": 1, "status": "running", "cursor": first["next_cursor"]})
    assert ok.status_code == 200 and len(ok.json()["jobs"]) == 1


def test_other_tenants_jobs_are_never_listed(api, jobs, flows, registry):
    registry.register("globex", parse_flow(flow("f")))
    mine = create(jobs)
    jobs.create("globex", JobRequest(flow_id="f"))
    assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [mine]


# -- every path that changes a status ---------------------------------------------------------------

def test_create_lease_complete_fail_and_control_paths_keep_the_index_true(ledger, jobs, flows):
    a, b, c = create(jobs), create(jobs, "g"), create(jobs, "fragile")
    assert_indexed(ledger)
    for act in (lambda: ledger.pause(a, "t"), lambda: jobs.resume("acme", a, ResumeRequest(), "t"),
                lambda: ledger.hold(a, "t", "why"), lambda: ledger.release(a, "t")):
        act()
        assert_indexed(ledger)
    while (lease := ledger.lease(b)) is not None:  # lease + complete until the job succeeds
        ledger.complete(b, lease.seq, lease.lease_token, {"ok": 1})
    assert ledger.job_fields(b)["status"] == "succeeded"
    assert_indexed(ledger)
    jobs.resume("acme", b, ResumeRequest(cursor={"type": "offset", "offset": 0}), "t")  # replan: succeeded -> running
    assert ledger.job_fields(b)["status"] == "running"
    assert_indexed(ledger)
    lease = ledger.lease(c)
    ledger.fail(c, lease.seq, lease.lease_token, "boom", retryable=False)  # budget 0: the job fails
    assert ledger.job_fields(c)["status"] == "failed"
    assert_indexed(ledger)
    assert ledger.reopen(c, "t", only_failed=True) == 1  # retry-failed: failed -> running
    assert ledger.job_fields(c)["status"] == "running"
    assert_indexed(ledger)
    ledger.cancel(a, "t")
    assert_indexed(ledger)
    assert listed(jobs, "acme", status="cancelled") == [a]


def test_supervisor_expiry_and_recovery_paths_keep_the_index_true(ledger, jobs, registry, settings):
    registry.register("acme", parse_flow(flow("short", stages=[
        {"name": "s", "lease": 0.05, "retry": {"maximum_attempts": 1}}],
        tolerated_failure_percentage=0)))
    job_id = create(jobs, "short")
    assert ledger.lease(job_id) is not None
    time.sleep(0.1)
    ledger.expire_due(job_id)  # what the supervisor's pass calls: out of attempts, the job fails
    assert ledger.job_fields(job_id)["status"] == "failed"
    assert_indexed(ledger)
    other = create(jobs, "short")
    record = Ledger(ledger.r, settings.model_copy(update={"recovery": "record"}))
    recover_jobs(record, "sup", int(time.time() * 1000) + 1000)  # found running at a restart: held
    assert ledger.job_fields(other)["status"] == "held"
    assert_indexed(ledger)
    assert listed(jobs, "acme", status="held") == [other]


def test_migration_files_the_job_under_its_new_flow_version(ledger, jobs, flows):
    job_id = create(jobs, "f", "1")
    ledger.pause(job_id, "t")
    migrate(ledger, ledger.spec(job_id), parse_flow(flow("f", "2")), flows.get("acme", "f", "2")["hash"],
            "t", "fixed")
    assert_indexed(ledger)
    assert listed(jobs, "acme", flow_id="f", flow_version="2") == [job_id]
    assert listed(jobs, "acme", flow_id="f", flow_version="1") == []


def test_an_outage_pause_files_the_job_as_paused(settings, redis_client, make_job):
    from tests.test_outage import closed_port
    from tests.test_outage import flow as outage_flow
    from gateway.push.dispatch import Dispatcher

    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"],
                                      "outage_pause_after": timedelta(seconds=1),
                                      "outage_cooldown_max": timedelta(milliseconds=300)})
    ledger = Ledger(redis_client, own)
    d = Dispatcher.build(own, ledger)
    job_id = make_job(items=[1, 2], max_items=1, stage_defs=outage_flow(closed_port()))
    deadline = time.monotonic() + 10
    while ledger.job_fields(job_id)["status"] == "running":
        assert time.monotonic() < deadline, "the job was never paused"
        d.run_ready(job_id)
        time.sleep(0.05)
    assert_indexed(ledger)


def test_random_status_changes_keep_listings_equal_to_a_scan(ledger, jobs, flows):
    """A model check: random operations on random jobs; after each, the raw index equals the records;
    at the end every filter's listing, paged, equals a brute-force scan."""
    rng = random.Random(16)
    ids = [create(jobs, rng.choice(["f", "g", "fragile"])) for _ in range(10)]

    def step(job_id: str) -> None:
        op = rng.choice(["pause", "resume", "hold", "release", "cancel", "retry", "work", "fail"])
        try:
            if op == "pause":
                ledger.pause(job_id, "m")
            elif op == "resume":
                jobs.resume("acme", job_id, ResumeRequest(), "m")
            elif op == "hold":
                ledger.hold(job_id, "m", "model")
            elif op == "release":
                ledger.release(job_id, "m")
            elif op == "cancel" and rng.random() < 0.3:
                ledger.cancel(job_id, "m")
            elif op == "retry":
                ledger.reopen(job_id, "m", only_failed=True)
            elif (lease := ledger.lease(job_id)) is not None:
                if op == "work":
                    ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})
                else:
                    ledger.fail(job_id, lease.seq, lease.lease_token, "x", retryable=False)
        except Exception as exc:  # noqa: BLE001 - refusals (409) are part of the model
            assert getattr(exc, "status", None) in (404, 409), exc

    for _ in range(150):
        step(rng.choice(ids))
        assert_indexed(ledger)
    assert len({f.status for f in truth(ledger, "acme").values()}) >= 3
    for status in (None, *STATUSES):
        for fl in ({}, {"flow_id": "f"}, {"flow_id": "fragile", "flow_version": "1"}):
            for order in ("newest", "oldest"):
                query = {"status": status, "order": order, "limit": 3, **fl}
                assert listed(jobs, "acme", **query) == brute_list(ledger, "acme", ListQuery(**query))


# -- faults ----------------------------------------------------------------------------------------

def test_a_lost_index_update_is_hidden_by_verify_on_read_and_repaired_by_the_supervisor(ledger, jobs, flows):
    a, b = create(jobs), create(jobs)
    k = ledger.keys.job(a)
    spec = ledger.spec(a)
    # the script commits, the process dies before the index update: run it without the index hook
    ledger.scripts.set_status.script(keys=[k.job, k.log, k.audit, k.events],
                                     args=["paused", "running", 100, "t", "", spec.budget_total,
                                           spec.flow.tolerated_failure_percentage])
    assert ledger.job_fields(a)["status"] == "paused"
    assert ledger.r.hget(ledger.keys.job_index_meta("acme"), a).startswith("running ")  # stale
    assert listed(jobs, "acme", status="running", limit=1) == [b]  # checked on read, filed again
    assert listed(jobs, "acme", status="paused") == [a]
    assert_indexed(ledger)
    # a lost update no listing has read yet: the supervisor's pass repairs it
    ledger.scripts.set_status.script(keys=[k.job, k.log, k.audit, k.events],
                                     args=["running", "paused", 100, "t", "", spec.budget_total,
                                           spec.flow.tolerated_failure_percentage])
    Supervisor(ledger).tick()
    assert_indexed(ledger)
    assert listed(jobs, "acme", status="running") == [b, a]


def test_deleted_or_corrupted_entries_heal_within_a_supervisor_pass(ledger, jobs, flows):
    ids = [create(jobs) for _ in range(3)]
    ledger.pause(ids[0], "t")
    f = truth(ledger, "acme")[ids[0]]
    ledger.r.zrem(ledger.keys.job_index("acme", "paused"), member(f.created_ms, ids[0]))
    ledger.r.hset(ledger.keys.job_index_meta("acme"), ids[1], "garbage")
    created = truth(ledger, "acme")[ids[2]].created_ms
    ledger.r.zrem(ledger.keys.job_index("acme", "running", "f", "1"), member(created, ids[2]))
    ledger.r.delete(ledger.keys.job_index("acme", "running", "f"))
    Supervisor(ledger).tick()
    assert_indexed(ledger)


def test_an_index_write_that_fails_after_the_script_loses_nothing(ledger, jobs, flows, monkeypatch):
    job_id = create(jobs)

    def down(*args, **kwargs):
        raise ConnectionError("Redis went away between the script and the index")

    monkeypatch.setattr(ledger.index, "refile", down)
    assert ledger.pause(job_id, "t") == "running"  # the pause committed and answered
    monkeypatch.undo()
    assert ledger.job_fields(job_id)["status"] == "paused"
    Supervisor(ledger).tick()
    assert_indexed(ledger)


def test_rebuild_regenerates_the_index_from_the_records(ledger, jobs, flows):
    ids = created_in_order(jobs, ("f", None), ("g", None), ("f", None))
    ledger.pause(ids[1], "t")
    for key in ledger.r.scan_iter(ledger.keys.job_index_pattern("acme")):
        ledger.r.delete(key)
    ledger.r.zadd(ledger.keys.job_index("acme", "held"), {member(1, "job_ghost"): 0})  # a stray
    assert listed(jobs, "acme") == []
    report = ledger.index.rebuild_all()
    assert report["acme"]["filed"] == 3
    assert_indexed(ledger)
    assert listed(jobs, "acme") == ids[::-1]


def test_a_starting_supervisor_indexes_jobs_made_before_the_index_existed(ledger, jobs, flows):
    """The upgrade: jobs whose records predate the index are listed once a supervisor has started,
    with no manual reindex; a second start does not rebuild again."""
    ids = created_in_order(jobs, ("f", None), ("g", None))
    ledger.pause(ids[0], "t")
    for key in ledger.r.scan_iter(ledger.keys.job_index_pattern("acme")):
        ledger.r.delete(key)
    ledger.r.delete(ledger.keys.job_index_built)  # as a deployment of the version before the index
    assert listed(jobs, "acme") == []
    sup = Supervisor(ledger, name="upgrade")
    threading.Thread(target=sup.run, daemon=True).start()
    try:
        deadline = time.monotonic() + 10
        while listed(jobs, "acme") != ids[::-1]:
            assert time.monotonic() < deadline, "the supervisor did not build the index"
            time.sleep(0.05)
    finally:
        sup.stop.set()
    assert listed(jobs, "acme", status="paused") == [ids[0]]
    assert_indexed(ledger)
    assert ledger.index.ensure_built() is False  # built once per index format


def test_jobs_whose_retention_ran_out_leave_the_index_roster_and_quota_set(ledger, jobs, flows):
    old, kept = create(jobs), create(jobs)
    ledger.r.sadd(ledger.keys.quota_active("acme"), old)
    f = truth(ledger, "acme")[old]
    for key in ledger._all_keys(old):  # what retention's expiry does
        ledger.r.delete(key)
    ledger.forget(old)
    assert listed(jobs, "acme") == [kept]
    assert ledger.r.zscore(ledger.keys.jobs("acme"), old) is None
    assert not ledger.r.sismember(ledger.keys.quota_active("acme"), old)
    for key in ledger.index.keys_of("acme", f):
        assert ledger.r.zscore(key, member(f.created_ms, old)) is None
    assert_indexed(ledger)


def test_redis_restarted_from_its_aof_keeps_the_index(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", fsync="always")
    url = server.start()
    try:
        settings = Settings(redis_url=url, data_dir=tmp_path / "data")
        ledger = Ledger(client_for(url), settings)
        registry = FlowRegistry(ledger.r, ledger.keys)
        registry.register("acme", parse_flow(flow()))
        jobs = JobService(ledger, registry)
        ids = [create(jobs) for _ in range(4)]
        ledger.pause(ids[1], "t")
        server.kill()
        server = EmbeddedRedis(tmp_path / "redis", fsync="always")
        assert server.start() == url
        ledger = Ledger(client_for(url), settings)
        assert_indexed(ledger)
        assert listed(JobService(ledger, registry), "acme", status="paused") == [ids[1]]
    finally:
        server.stop()


# -- CLI -------------------------------------------------------------------------------------------

def test_cli_lists_with_filters_and_pages_and_reindex_rebuilds(api, ledger, jobs, flows, monkeypatch, capsys,
                                                               redis_server):
    from gateway.runtime.cli import main
    from tests.conftest import TOKEN

    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)
    ids = created_in_order(jobs, ("f", "2"), ("f", None), ("f", None))
    ledger.pause(ids[0], "t")

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(["jobs", "list", "--url", api.base, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, err = cli("--limit", "2")
    assert code == 0 and len(out.splitlines()) == 2 and "--all" in err
    code, out, err = cli("--limit", "2", "--all")
    assert [line.split()[0] for line in out.splitlines()] == ids[::-1] and err == ""
    code, out, _ = cli("--flow", "f@2", "--status", "paused", "--oldest")
    assert [line.split()[0] for line in out.splitlines()] == [ids[0]]
    for key in ledger.r.scan_iter(ledger.keys.job_index_pattern("acme")):
        ledger.r.delete(key)
    monkeypatch.setenv("BATCHGATE_REDIS_URL", redis_server.url)
    assert main(["reindex"]) == 0
    assert "acme: 3 jobs filed" in capsys.readouterr().out
    assert_indexed(ledger)
