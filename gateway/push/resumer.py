"""Resume a platform run once a person decided the approval it opened (issue 16).

A platform run that waits for a person (``connectors.base.WaitingHuman`` with a resume handle) makes the
dispatcher keep the run's poll handle on the batch (handle.lua) and open a platform approval showing the
platform's prompt (``Ledger.open_platform_approval``), which releases the lease: no worker, slot or
concurrency is held while the person decides. decide.lua then either approves (the batch is ready again
at its stage without spending an attempt; the record keeps the decision and the person's ``output``) or
rejects (the batch fails as ``rejected``). The run itself is told on two paths:

- fast: the ledger calls :class:`PlatformResumer` (``Ledger.register_resumer``, installed by
  :func:`install` in the API and the supervisor, which decides timeouts) right after the decision, and it
  resumes the run through its connector (``connectors.resume``), rejection included where the platform
  takes one.
- durable: the batch's next attempt polls the kept handle (``Dispatcher._earlier_run``). A run that still
  waits at the very wait that was approved (the fast path never ran: a crash between the decision and the
  call, or the platform was down) is resumed there by the dispatcher with the recorded decision
  (:func:`decided_for`).

Neither path commits. The output comes from the batch's next attempt, which reads the run through the
ordinary poll and commit path (commit.lua, once per batch and stage), so it is committed exactly once
however often and by whom the run was resumed; a resume that meets a run that already resumed reads it
(each connector settles a resume by the run's own state).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from connectors.base import Decision, Outcome, PlatformError, Retry, WaitingHuman
from connectors.resume import connector_for
from gateway.errors import BatchgateError
from gateway.ledger.approvals import ApprovalRef
from gateway.ledger.jobspec import JobSpec
from gateway.ledger.records import loads_or_none
from gateway.net.outbound import session_for
from gateway.net.urlguard import UnsafeURL, check_url

if TYPE_CHECKING:
    from gateway.push.dispatch import Dispatcher

log = logging.getLogger(__name__)

SAME_WAIT_KEYS = ("node", "node_runs", "form_token", "event_id")
"""Handle fields that tell one wait of a run from a later one (n8n node and its run count, Dify's form,
Coze's interrupt event); compared where both handles have them."""
WATCH_FIELDS = {"run_id": "workflow_run_id"}
"""A poll handle's key -> the resume handle's field naming the same run (others share their names)."""


def decision_of(rec: dict[str, str]) -> Decision:
    """The connector's view of a decided approval record."""
    return Decision(approved=rec.get("decision") == "approve", comment=rec.get("comment") or None,
                    output=loads_or_none(rec.get("output") or ""), actor=rec.get("actor") or None)


def platform_handle(rec: dict[str, str]) -> dict[str, Any] | None:
    """The resume handle a platform approval record keeps, or None."""
    handle = loads_or_none(rec.get("platform") or "")
    return handle if isinstance(handle, dict) and handle.get("platform") else None


def same_wait(stored: dict[str, Any], seen: WaitingHuman) -> bool:
    """Whether ``seen`` (a fresh read of the run) waits where the approved handle ``stored`` did."""
    fresh = seen.resume
    if fresh is None:  # the read names no wait (a Dify run status, a Coze history): the same run is enough
        return bool(seen.watch) and all(str(stored.get(WATCH_FIELDS.get(k, k))) == str(v)
                                        for k, v in seen.watch.items())
    if fresh.get("platform") != stored.get("platform"):
        return False
    return all(fresh.get(k) == stored.get(k) for k in SAME_WAIT_KEYS if k in fresh and k in stored)


def decided_for(dispatcher: Dispatcher, job_id: str, seq: int, stage_idx: int,
                seen: WaitingHuman) -> tuple[dict[str, Any], Decision] | None:
    """The approved handle and decision of the batch's latest platform approval at ``stage_idx``, when
    the run ``seen`` still waits at that very wait (the durable path), else None."""
    ledger = dispatcher.ledger
    rnd = ledger.r.hget(ledger.keys.job(job_id).batch(seq), f"ap_n:{stage_idx}")
    if not rnd or not str(rnd).isdigit():
        return None
    try:
        rec = ledger.approvals.record(ApprovalRef(job_id, seq, stage_idx, int(rnd)))
    except BatchgateError:
        return None
    handle = platform_handle(rec)
    if rec.get("kind") != "platform" or rec.get("status") != "approved" or handle is None:
        return None
    return (handle, decision_of(rec)) if same_wait(handle, seen) else None


def settle_wait(dispatcher: Dispatcher, spec: JobSpec, seq: int, stage_idx: int, token: str,
                seen: WaitingHuman, where: dict[str, Any], resumed: bool) -> Outcome | PlatformError | None:
    """A leased attempt found its run waiting for a person at a wait the platform can resume.

    Approved already (the durable path; not again right after resuming, ``resumed``): resume it with the
    recorded decision and return what that gives, for the dispatcher to act on. Otherwise: keep the run's
    poll handle on the batch (the next attempt asks the run, never starts the flow again), open a platform
    approval showing the platform's prompt (the lease is released) and return None.
    """
    decided = None if resumed else decided_for(dispatcher, spec.job_id, seq, stage_idx, seen)
    if decided is not None:
        dispatcher.ledger.note(spec.job_id, "resuming_decided_wait", **where, **seen.platform_ids)
        return resume_run(dispatcher, spec, seq, stage_idx, *decided, token=token)
    dispatcher._remember_run(spec, seq, token, seen.watch or {})
    dispatcher.ledger.note(spec.job_id, "waiting_on_person", **where, prompt=seen.prompt,
                           error=seen.message[:500], **seen.platform_ids)
    opened = dispatcher.ledger.open_platform_approval(spec.job_id, seq, token,
                                                      seen.prompt or seen.message[:500], platform=seen.resume)
    log.info("platform run waits for a person job_id=%s seq=%s approval=%s", spec.job_id, seq,
             opened.get("approval_id"))
    return None


class PlatformResumer:
    """Resumes the run of a decided platform approval (the fast path); ``Ledger.register_resumer`` hook.

    The resume runs in a thread of its own: it may follow the run for a while (a Dify or Coze stream reads
    the rest of the run), and the person's request must not wait for it. A process that dies meanwhile
    loses nothing: the durable path resumes the run at the batch's next attempt.
    """

    def __init__(self, dispatcher: Dispatcher, background: bool = True) -> None:
        self.dispatcher = dispatcher
        self.background = background

    def __call__(self, approval: dict[str, Any], decision: dict[str, Any]) -> None:
        if not self.background:
            return self.resume(approval)
        threading.Thread(target=self._logged, args=(approval,), name=f"resume-{approval.get('id')}",
                         daemon=True).start()
        return None

    def _logged(self, approval: dict[str, Any]) -> None:
        try:
            self.resume(approval)
        except Exception:  # noqa: BLE001 - the decision stands; the batch's next attempt resumes the run
            log.exception("platform resume failed approval=%s", approval.get("id"))

    def resume(self, approval: dict[str, Any]) -> None:
        """Resume the run of a decided platform approval (its record names the run and the decision)."""
        ref = ApprovalRef(approval["job_id"], int(approval["seq"]), int(approval["stage_index"]),
                          int(approval["round"]))
        rec = self.dispatcher.ledger.approvals.record(ref)
        handle = platform_handle(rec)
        if handle is None or rec.get("status") not in ("approved", "rejected"):
            return  # an answer-contract wait (nothing to resume) or not decided
        spec = self.dispatcher.ledger.spec(ref.job_id)
        with session_for(self.dispatcher.settings) as session:  # this thread's own, guarded like calls
            outcome = resume_run(self.dispatcher, spec, ref.seq, ref.stage, handle, decision_of(rec),
                                 session=session)
        what = type(outcome).__name__
        log.info("platform run resumed approval=%s job_id=%s seq=%s decision=%s outcome=%s", ref.id,
                 ref.job_id, ref.seq, rec.get("decision"), what)
        fields = {"seq": ref.seq, "stage": spec.flow.stages[ref.stage].name, "approval": ref.id,
                  "decision": rec.get("decision")}
        if not isinstance(outcome, PlatformError):
            event, error = "platform_resumed", None
        elif outcome.code == "rejected":  # the platform takes no rejection: its run still waits there
            event, error = "platform_not_resumed", outcome.message[:500]
        else:  # approved: the batch's next attempt resumes it (durable path); rejected: it stays waiting
            event, error = "platform_resume_failed", outcome.message[:500]
        self.dispatcher.ledger.note(ref.job_id, event, **fields, error=error)
        self.dispatcher.kick(ref.job_id)  # the batch's next attempt collects the run's answer


def resume_run(dispatcher: Dispatcher, spec: JobSpec, seq: int, stage_idx: int, handle: dict[str, Any],
               decision: Decision, token: str = "", session: Any = None) -> Outcome | PlatformError:
    """Resume the run ``handle`` names through its connector, behind the outbound guard; failures come
    back as values (as ``Dispatcher._guarded`` does for calls). ``token``: the lease the caller holds (the
    durable path), heartbeated while the connector follows the run."""
    stage = spec.flow.stages[stage_idx]
    try:
        batch = dispatcher.ledger.batch_record(spec.job_id, seq)
        call = dispatcher._stage_call(spec, stage, batch, seq, stage_idx, int(batch.get("attempt") or 1),
                                      token, items=None, called_s=time.time())
        connector = connector_for(handle.get("platform"))
        for url in (handle.get("resume_url"),):
            if isinstance(url, str):
                check_url(url, dispatcher.allow)
    except UnsafeURL as exc:
        return PlatformError(exc.detail, Retry.FATAL)
    except PlatformError as exc:
        return exc
    session = session or dispatcher.session
    return dispatcher._guarded(call, stage, lambda: connector.resume(call, handle, decision, session))


def install(dispatcher: Dispatcher | None, background: bool = True) -> None:
    """Register the fast path with the dispatcher's ledger (API, supervisor); no dispatcher, no push."""
    if dispatcher is not None:
        dispatcher.ledger.register_resumer(PlatformResumer(dispatcher, background))
