"""A platform-fed source: the first stage fetches each batch's items and names the next cursor."""

from __future__ import annotations

PAGES = {None: ([1, 2, 3], "p2"), "p2": ([4, 5, 6], "p3"), "p3": ([7], None)}


def test_fetch_process_store_over_an_external_source(api):
    flow = {"id": "fetched", "version": "1", "source": {"type": "external"}, "concurrency": 4,
            "stages": [{"name": "fetch", "fetches": True}, {"name": "process"}, {"name": "store"}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "fetched"}).json()["job_id"]
    stored, fetch_cursors = [], []
    while (r := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        env = r.json()
        done = {"lease_token": env["lease_token"]}
        if env["stage"] == "fetch":
            assert env["items"] is None
            fetch_cursors.append(env["cursor"])
            items, nxt = PAGES[env["cursor"]]
            done.update(output={"items": items}, next_cursor=nxt)
        elif env["stage"] == "process":
            done["output"] = {"doubled": [i * 2 for i in env["items"]]}
        else:
            stored.extend(env["input"]["doubled"])
            done["output"] = {"stored": len(env["input"]["doubled"])}
        assert api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete", json=done).status_code == 200
    assert r.headers["Batchgate-Job-Status"] == "succeeded"
    assert fetch_cursors == [None, "p2", "p3"]  # each batch planned only after the previous fetch
    assert sorted(stored) == [2, 4, 6, 8, 10, 12, 14]
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["items_done"] == 7 and job["batches"]["completed"] == 3


def test_only_the_fetch_stage_may_send_items(api):
    flow = {"id": "fetched2", "version": "1", "source": {"type": "external"},
            "stages": [{"name": "fetch", "fetches": True}, {"name": "process"}]}
    api.post("/v1/flows", json=flow)
    job_id = api.post("/v1/jobs", json={"flow_id": "fetched2"}).json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease").json()
    api.post(f"/v1/jobs/{job_id}/batches/0/complete",
             json={"lease_token": env["lease_token"], "output": {"items": [1]}, "next_cursor": None})
    env = api.post(f"/v1/jobs/{job_id}/lease").json()
    assert env["stage"] == "process" and env["items"] == [1]
    resp = api.post(f"/v1/jobs/{job_id}/batches/0/complete",
                    json={"lease_token": env["lease_token"], "output": {}, "items": [9, 9]})
    assert resp.status_code == 422
    assert api.get(f"/v1/jobs/{job_id}/batches/0").json()["status"] == "leased"


def test_external_source_needs_a_fetching_stage(api):
    flow = {"id": "bad", "version": "1", "source": {"type": "external"}, "stages": [{"name": "process"}]}
    resp = api.post("/v1/flows", json=flow)
    assert resp.status_code == 422 and "fetches" in str(resp.json())
