"""Crashes on a Redis Cluster (3 masters, 3 replicas; tests/cluster.py), with two gateways, two
supervisors and two workers as real processes.

- The gateway SIGKILLed during completions (tests/test_crash.py's scenario, its body reused): two
  gunicorn gateways, two supervisors, pull workers over HTTP riding out the kills.
- A push job while a worker, a gateway and a supervisor are SIGKILLed in turn (each started again),
  and while the master of the job's slot is SIGKILLed with BATCHGATE_REDIS_WAIT_REPLICAS=1: every
  batch is stored once, no stage committed twice, the job finishes; after the failover no commit that
  a replica had acknowledged is redone.
- A creation cut between its slot groups (the job's keys written, the roster, index, active set and
  due index not): the next supervisor pass files it, and it runs.
"""

from __future__ import annotations

import time

import pytest
import redis

from gateway.ledger.embedded import client_for
from gateway.ledger.ledger import Ledger
from tests.conftest import TOKEN

pytestmark = pytest.mark.slow


# -- a creation cut between its slot groups ---------------------------------------------------------

def test_a_creation_killed_between_its_slot_groups_is_filed_by_the_next_supervisor_pass(
        cluster, cluster_settings, cluster_client, monkeypatch):
    """The process creating a job dies after the MULTI of the job's own slot (spec, state, log) and
    before the roster, index, active set and due index: the job answers but is not listed. A
    supervisor started afterwards (its own client) files it from the creation journal: it is listed,
    supervised (a lease left to run out is expired) and runs to the end."""
    from gateway.ledger import creations
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.joblist import ListQuery
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.multi import SlotMulti
    from gateway.push.supervisor import Supervisor
    from tests.conftest import drain

    ledger = Ledger(cluster_client, cluster_settings)
    registry = FlowRegistry(cluster_client, ledger.keys)
    jobs = JobService(ledger, registry)
    registry.register("acme", parse_flow({"id": "f", "version": "1", "stages": [{"name": "s", "lease": 0.3,
                                                                  "retry": {"initial_interval": 0.05}}],
                                          "batching": {"max_items": 2},
                                          "source": {"type": "sequence", "count": 6}}))
    executed = SlotMulti.execute

    def killed_after_the_job_slot(self, raise_on_error=True):
        first = self.client.keyslot(self._queued[0][1][0])  # the job's keys are queued first
        self._queued = [q for q in self._queued if self.client.keyslot(q[1][0]) == first]
        executed(self, raise_on_error)
        raise redis.ConnectionError("the creating process died here")

    monkeypatch.setattr(SlotMulti, "execute", killed_after_the_job_slot)
    with pytest.raises(redis.ConnectionError):
        jobs.create("acme", JobRequest(flow_id="f"))
    monkeypatch.undo()
    (job_id,) = cluster_client.zrange(ledger.keys.creating, 0, -1)
    assert ledger.job_fields(job_id)["status"] == "running"  # the job's own keys are there
    assert jobs.list("acme", ListQuery()).jobs == []
    assert not cluster_client.sismember(ledger.keys.active, job_id)

    fresh = client_for(cluster.url, cluster_settings)  # another process, in effect
    try:
        sup = Supervisor(Ledger(fresh, cluster_settings), name="after-the-crash")
        sup.tick()  # within the grace: a creation may still be going on
        assert not cluster_client.sismember(ledger.keys.active, job_id)
        monkeypatch.setattr(creations, "GRACE_MS", 0)
        sup.tick()
        assert [j["job_id"] for j in jobs.list("acme", ListQuery()).jobs] == [job_id]
        assert cluster_client.sismember(ledger.keys.active, job_id)
        assert cluster_client.zrange(ledger.keys.creating, 0, -1) == []
        lost = ledger.lease(job_id)  # its holder dies: the supervisor must find the lease
        time.sleep(0.4)
        sup.tick()
        expired = [f for _, f in cluster_client.xrange(ledger.keys.job(job_id).log)
                   if f["event"] == "retry_scheduled"]
        assert [f["seq"] for f in expired] == [str(lost.seq)]
        time.sleep(0.2)  # the retry's backoff
        drain(ledger, job_id)
        assert ledger.job_fields(job_id)["status"] == "succeeded"
        sup.tick()  # retired
        assert not cluster_client.sismember(ledger.keys.active, job_id)
    finally:
        fresh.close()


# -- the gateway SIGKILLed during completions (tests/test_crash.py) ----------------------------------

def test_gateway_sigkill_during_completions_on_two_gateways_and_supervisors(cluster, cluster_settings,
                                                                             cluster_client):
    from tests.test_crash import gateway_kills

    gateway_kills(cluster.url, cluster_client, cluster_settings, gateways=2, supervisors=2)
