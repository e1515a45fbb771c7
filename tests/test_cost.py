"""Cost ledger and dry runs (issue 19 items 2 and 3) against a Dify stand-in on a real socket that bills
tokens and a price per run: the job's cost is what it billed, a worker killed mid-call shows its re-run
as redone with its cost, a budget pauses the job before the call that would pass it, and a dry run
counts the batches and calls the real run makes without calling anything."""

from __future__ import annotations

import json
import time

import pytest
import requests

from gateway.push.dispatch import Dispatcher
from tests.platforms import FakeDify
from tests.test_push_e2e import push_stack, wait_done

KEY = "app-cost-key"
SECRETS = {"acme": {"dify_app": KEY}}


def dify_flow(dify: FakeDify, flow_id: str = "costly", count: int = 10, **extra) -> dict:
    return {"id": flow_id, "version": "1", "batching": {"max_items": 2}, "concurrency": 1,
            "source": {"type": "sequence", "count": count},
            "stages": [{"name": "summarise", "lease": 2, "idempotent": True, "timeout": 10,
                        "retry": {"initial_interval": 0.1, "maximum_attempts": 5},
                        "target": {"type": "dify", "base_url": dify.base_url, "api_key_secret": "dify_app",
                                   "mode": "blocking", "max_in_flight": 1}}], **extra}


def billing_dify() -> FakeDify:
    dify = FakeDify(api_key=KEY)
    dify.tokens_per_item = 50
    return dify


def test_job_cost_is_what_the_platform_billed_and_a_dry_run_counts_its_batches(
        settings, redis_client, tmp_path):
    with billing_dify() as dify, push_stack(settings, redis_client, tmp_path / "data", workers=1,
                                            secrets=SECRETS) as (api, ledger, _):
        assert api.post("/v1/flows", json=dify_flow(dify, count=9)).status_code == 201
        # what the running processes write by themselves: the boot record, their liveness beats
        own = {ledger.keys.boot, *(ledger.keys.alive(role) for role in ("supervisor", "worker", "api"))}
        before = set(redis_client.keys("*")) - own
        plan = api.post("/v1/jobs", json={"flow_id": "costly", "dry_run": True})
        assert plan.status_code == 200, plan.text
        plan = plan.json()
        # nothing called, nothing written (no job, quota slot or idempotency record; boot: the supervisor)
        assert dify.requests == [] and set(redis_client.keys("*")) - own == before
        job_id = api.post("/v1/jobs", json={"flow_id": "costly"}).json()["job_id"]
        job = wait_done(api, job_id, 60)
        billed = list(dify.billed)
        second = api.post("/v1/jobs", json={"flow_id": "costly", "dry_run": True}).json()
    assert job["status"] == "succeeded", job
    cost = job["cost"]
    assert cost["calls"] == cost["paid_calls"] == len(billed) == 5
    assert cost["tokens"] == sum(t for _, t, _ in billed)
    assert cost["price"] == pytest.approx(sum(float(p) for _, _, p in billed))
    assert cost["currency"] == "USD"
    assert cost["by_reason"] == {"first": 5} and cost["redone"]["calls"] == 0
    assert cost["stages"]["summarise"]["tokens"] == cost["tokens"]
    # the dry run's batches and calls are the real run's
    assert plan["batches"] == job["batches"]["planned"] == 5 and plan["batches_confidence"] == "exact"
    assert plan["calls"] == {"summarise": 5}
    # once the flow has a cost ledger and the target a latency history, the second plan prices the job
    assert second["cost"]["tokens"] == cost["tokens"]
    assert second["cost"]["price"] == pytest.approx(cost["price"])
    assert second["duration_s"] is not None and second["stages"][0]["call_seconds_samples"] == 5


@pytest.mark.parametrize(("budget", "named"), [({"tokens": 350}, "350 tokens"),
                                               ({"price": 0.07}, "0.07 price")])
def test_budget_pauses_the_job_before_the_call_that_would_pass_it(settings, redis_client, tmp_path, budget,
                                                                  named):
    with billing_dify() as dify, push_stack(settings, redis_client, tmp_path / "data", workers=0,
                                            secrets=SECRETS) as (api, ledger, _):
        # each call bills 100 tokens (0.02): after 3 calls (300, 0.06) the 4th would pass 350 (0.07)
        flow = dify_flow(dify, count=20, budget=budget)
        assert api.post("/v1/flows", json=flow).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "costly"}).json()["job_id"]
        own = ledger.settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "secrets": SECRETS})
        dispatcher = Dispatcher.build(own, ledger)
        ran = dispatcher.run_ready(job_id)
        job = api.get(f"/v1/jobs/{job_id}").json()
        calls = len([r for r in dify.requests if r.method == "POST"])
        # resuming is the decision to go on past the budget: no second pause
        assert api.post(f"/v1/jobs/{job_id}/resume", json={}).status_code == 200
        rest = dispatcher.run_ready(job_id)
        after = api.get(f"/v1/jobs/{job_id}").json()
    assert ran == 3 and calls == 3
    assert job["status"] == "paused"
    assert job["paused_reason"].startswith("cost budget: ") and named in job["paused_reason"]
    assert job["cost"]["tokens"] == 300 and job["cost"]["budget"]["paused"]
    assert rest == 7 and after["status"] == "succeeded" and after["paused_reason"] is None
    assert after["cost"]["tokens"] == 1000


def test_a_worker_killed_mid_call_shows_its_rerun_as_redone_with_its_cost(settings, redis_client, tmp_path):
    with billing_dify() as dify, push_stack(settings, redis_client, tmp_path / "data", workers=1,
                                            secrets=SECRETS) as (api, ledger, workers):
        dify.slow_s = 4
        dify.plan("slow")  # the first run answers after 4 s: the worker is killed before that
        assert api.post("/v1/flows", json=dify_flow(dify, count=6)).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "costly"}).json()["job_id"]
        deadline = time.monotonic() + 30
        while not dify.requests:
            assert time.monotonic() < deadline, "the worker never called the stand-in"
            time.sleep(0.02)
        workers.kill()  # SIGKILL: the call's answer is lost; its lease expires after 2 s
        workers.start()
        job = wait_done(api, job_id, 60)
        time.sleep(4.5)  # let the killed call's run finish (and bill) on the stand-in
        billed = list(dify.billed)
    assert job["status"] == "succeeded", job
    cost = job["cost"]
    assert cost["calls"] == 3 and len(billed) == 4  # the killed call's run billed, its answer never came
    assert cost["by_reason"] == {"first": 2, "rerun": 1}
    assert cost["redone"]["calls"] == 1
    assert cost["redone"]["tokens"] == 100 and cost["redone"]["price"] == pytest.approx(100 * 0.0002)
    assert cost["tokens"] == sum(t for _, t, _ in billed) - 100  # all but the lost call's bill


PULL_FLOW = {"id": "pull-cost", "version": "1", "batching": {"max_items": 5},
             "source": {"type": "sequence", "count": 12},
             "stages": [{"name": "score", "lease": 30,
                         "retry": {"maximum_attempts": 3, "initial_interval": 0.01}},
                        {"name": "store", "lease": 30}]}


def test_pull_clients_report_usage_and_the_cli_plans_and_shows_cost(api, monkeypatch, capsys):
    from gateway.runtime.cli import main
    from tests.conftest import TOKEN

    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)

    def cli(*argv: str) -> tuple[int, str]:
        code = main([*argv[:2], "--url", api.base, *argv[2:]])
        return code, capsys.readouterr().out

    assert api.post("/v1/flows", json=PULL_FLOW).status_code == 201
    code, out = cli("jobs", "plan", "--flow", "pull-cost")
    assert code == 0 and "batches   3 (exact" in out and "score            3 calls" in out
    code, out = cli("jobs", "plan", "--flow", "pull-cost", "--json")
    plan = json.loads(out)
    assert plan["calls"] == {"score": 3, "store": 3} and plan["cost"]["confidence"] == "unknown"
    assert api.get("/v1/jobs").json()["jobs"] == []  # planning created nothing
    job_id = api.post("/v1/jobs", json={"flow_id": "pull-cost"}).json()["job_id"]
    failed_once = False
    while (lease := api.post(f"/v1/jobs/{job_id}/lease", json={})).status_code == 200:
        env = lease.json()
        path = f"/v1/jobs/{job_id}/batches/{env['seq']}"
        if env["stage"] == "score" and not failed_once:  # a failed call is counted too, and its retry
            failed_once = True
            assert api.post(f"{path}/fail", json={"lease_token": env["lease_token"], "error": {
                "message": "model overloaded"}, "usage": {"tokens": 7}}).status_code == 200
            time.sleep(0.05)
            continue
        usage = {"tokens": 10, "price": 0.5, "currency": "eur"} if env["stage"] == "score" else None
        body = {"lease_token": env["lease_token"], "output": {"ok": True}}
        if usage:
            body["usage"] = usage
        assert api.post(f"{path}/complete", json=body).status_code == 200
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    code, out = cli("jobs", "cost", job_id)
    assert code == 0
    assert out.splitlines()[0].split() == ["job", "7", "calls", "(4", "paid),", "37", "tokens,", "price",
                                           "1.5", "EUR,"] + out.splitlines()[0].split()[10:]
    cost = json.loads(cli("jobs", "cost", job_id, "--json")[1])
    assert cost["by_reason"] == {"first": 6, "retry": 1}
    assert cost["stages"]["score"]["calls"] == 4 and cost["stages"]["store"]["paid_calls"] == 0
    # the next plan of this flow prices its calls from this job's ledger
    plan = api.post("/v1/jobs", json={"flow_id": "pull-cost", "dry_run": True}).json()
    assert plan["cost"]["tokens"] == round(37 / 4 * 3) and plan["stages"][0]["cost"]["from_calls"] == 4
    assert plan["stages"][0]["call_seconds_from"] == "flow_cost_ledger"
    # /metrics: calls by stage and reason, tokens and price (bounded labels: a currency code)
    scrape = requests.get(f"{api.base}/metrics", timeout=10).text
    assert 'batchgate_stage_calls_total{reason="retry",stage="score"}' in scrape
    assert 'batchgate_stage_price_total{currency="EUR",reason="first",stage="score"}' in scrape
    assert 'batchgate_stage_tokens_total{reason="retry",stage="score"}' in scrape


def test_a_replayed_answer_is_counted_once_and_a_lost_lease_makes_the_next_call_a_rerun(
        api, settings, redis_client):
    from gateway.ledger.ledger import Ledger

    flow = {**PULL_FLOW, "id": "pull-rerun", "source": {"type": "sequence", "count": 10},
            "stages": [{"name": "score", "lease": 1, "retry": {"initial_interval": 0.01}}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "pull-rerun"}).json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    body = {"lease_token": env["lease_token"], "output": 1, "usage": {"tokens": 5}}
    path = f"/v1/jobs/{job_id}/batches/{env['seq']}/complete"
    assert api.post(path, json=body).json()["duplicate"] is False
    assert api.post(path, json=body).json()["duplicate"] is True  # a retried request: counted once
    lost = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()  # its worker dies: the lease runs out
    time.sleep(1.2)
    assert Ledger(redis_client, settings).expire_due(job_id) == [(lost["seq"], "retry")]
    late = {"lease_token": lost["lease_token"], "output": 1, "usage": {"tokens": 5}}
    assert api.post(f"/v1/jobs/{job_id}/batches/{lost['seq']}/complete", json=late).status_code == 409
    time.sleep(0.1)  # the retry's backoff
    again = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    assert again["seq"] == lost["seq"] and again["attempt"] == 2
    body = {"lease_token": again["lease_token"], "output": 1, "usage": {"tokens": 6}}
    assert api.post(f"/v1/jobs/{job_id}/batches/{again['seq']}/complete", json=body).status_code == 200
    cost = api.get(f"/v1/jobs/{job_id}").json()["cost"]
    assert cost["calls"] == 2 and cost["tokens"] == 11  # the stale late answer was not counted
    assert cost["by_reason"] == {"first": 1, "rerun": 1}
    assert cost["redone"] == {"calls": 1, "tokens": 6, "price": None}


def drain(api, job_id: str) -> None:
    """Complete every batch of a one-stage pull job."""
    while (lease := api.post(f"/v1/jobs/{job_id}/lease", json={})).status_code == 200:
        env = lease.json()
        api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                 json={"lease_token": env["lease_token"], "output": None})


@pytest.mark.parametrize("kind", ["jsonl", "csv", "inline"])
def test_a_dry_run_cuts_the_batches_the_job_cuts(api, tmp_path, kind):
    # records of uneven sizes and max_bytes: the count needs the source read as the job reads it
    rows = [{"n": i, "text": "x" * (i * 7 % 40)} for i in range(57)]
    if kind == "jsonl":
        path = tmp_path / "items.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        source = {"type": "jsonl", "path": str(path)}
    elif kind == "csv":
        path = tmp_path / "items.csv"
        path.write_text("n,text\n" + "".join(f"{r['n']},{r['text']}\n" for r in rows))
        source = {"type": "csv", "path": str(path)}
    else:
        source = {"type": "inline", "items": rows}
    flow = {"id": f"cut-{kind}", "version": "1", "batching": {"max_items": 10, "max_bytes": 200},
            "stages": [{"name": "s"}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    plan = api.post("/v1/jobs", json={"flow_id": flow["id"], "source": source, "dry_run": True}).json()
    job_id = api.post("/v1/jobs", json={"flow_id": flow["id"], "source": source}).json()["job_id"]
    drain(api, job_id)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded"
    assert plan["batches"] == job["batches"]["planned"] == job["cost"]["calls"] > 57 // 10
    assert plan["items"] == job["items_done"] == 57 and plan["batches_confidence"] == "exact"


def test_a_pull_step_that_commits_and_leases_in_one_request_counts_its_usage(api):
    flow = {**PULL_FLOW, "id": "pull-step", "source": {"type": "sequence", "count": 10},
            "stages": [{"name": "score", "lease": 30}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "pull-step"}).json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    tokens = 3
    while env is not None:
        body = {"lease_token": env["lease_token"], "output": 1, "lease_next": True,
                "usage": {"tokens": tokens}}
        env = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete", json=body).json()["next"]
        tokens += 1
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["cost"]["calls"] == 2 and job["cost"]["tokens"] == 3 + 4


def test_polled_runs_are_billed_and_timed_from_their_trigger(settings, redis_client, tmp_path):
    with billing_dify() as dify, push_stack(settings, redis_client, tmp_path / "data", workers=1,
                                            secrets=SECRETS) as (api, ledger, _):
        dify.plan("async", "async")  # running at first: polled until it succeeds
        flow = dify_flow(dify, count=4)
        flow["stages"][0]["poll_interval"] = 0.2
        assert api.post("/v1/flows", json=flow).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "costly"}).json()["job_id"]
        job = wait_done(api, job_id, 60)
        billed = list(dify.billed)
        plan = api.post("/v1/jobs", json={"flow_id": "costly", "dry_run": True}).json()
    assert job["status"] == "succeeded" and job["cost"]["tokens"] == sum(t for _, t, _ in billed) == 200
    stage = plan["stages"][0]
    # both polled runs took at least one poll interval from their trigger to the answer
    assert stage["call_seconds_samples"] == 2 and stage["call_seconds"] >= 0.2
