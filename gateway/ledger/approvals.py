"""Approvals: batches that wait for a person (docs/design.md "Approvals").

A batch reaches an approval stage when its previous stage commits (complete.lua, through lib.lua
``advance``), is found at one in its ready set (re-opened there; the supervisor calls ``open_ready``),
or its platform answers that a person must decide (``open_platform``). Each opens one approval record
under the job's hash tag, ``approval:<seq>.<stage>.<round>``, whose id ``<job>.<seq>.<stage>.<round>``
names the job (so the id alone finds its keys) and is the same on every retry of the script that opens
it. ``decide`` records the decision in decide.lua, which also commits or fails the batch in the same step.

The tenant's listing (``keys.approval_index``) spans jobs, so it is written here after the scripts,
idempotently; a listing checks every record it returns and files it again when it moved, and the
supervisor re-files pending approvals a lost write left out (``heal``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gateway import metrics
from gateway.errors import Conflict, CorruptRecord, Forbidden, InvalidRequest, JobCancelled, NotFound
from gateway.ledger.multi import multi
from gateway.ledger.records import dumps, intact, loads_or_none

if TYPE_CHECKING:
    from gateway.ledger.jobspec import JobSpec
    from gateway.ledger.ledger import Ledger

log = logging.getLogger(__name__)

APPROVAL_ID = re.compile(r"(job_[A-Za-z0-9_-]{1,60})\.(\d{1,9})\.(\d{1,2})\.(\d{1,6})")
LISTED = ("pending", "approved", "rejected")
TIMEOUT_ACTOR = "supervisor:timeout"
TIMEOUT_DECISION = {"reject": "reject", "approve": "approve", "fail": "fail"}
PAGE_MAX = 200
#: A resumer hears of every decision on a platform approval (after it committed): fn(approval view,
#: decision view). It continues the platform's run (n8n's resume URL, Coze's resume call...); a resumer
#: that raises is logged and the decision stands (the batch is ready again and its next attempt asks the
#: platform about the run).
Resumer = Callable[[dict[str, Any], dict[str, Any]], None]


class ApprovalDecided(Conflict):
    """The approval was decided otherwise already; a decision never changes."""

    title = "Approval already decided"
    type_slug = "approval-decided"


@dataclass(frozen=True)
class ApprovalRef:
    """Where an approval lives: its job, batch seq, stage index and round."""

    job_id: str
    seq: int
    stage: int
    round: int

    @property
    def id(self) -> str:
        return f"{self.job_id}.{self.seq}.{self.stage}.{self.round}"

    @classmethod
    def parse(cls, approval_id: str) -> ApprovalRef:
        m = APPROVAL_ID.fullmatch(approval_id or "")
        if m is None:
            raise NotFound(f"no approval {approval_id[:100]!r}")
        return cls(m[1], int(m[2]), int(m[3]), int(m[4]))


def gates_arg(spec: JobSpec, first_key: int) -> str:
    """The flow's approval stages as the scripts take them (lib.lua: t, o, a, s, n, k), with ``k`` the
    KEYS index (1-based) of the round-1 record key of each, passed from ``first_key`` on in stage order;
    '' when the flow has none."""
    gates = spec.flow.gates()
    if not gates:
        return ""
    names = [s.name for s in spec.flow.stages]
    out = {}
    for j, (i, gate) in enumerate(sorted(gates.items())):
        out[str(i)] = _gate(gate, names, i) | {"k": first_key + j}
    return dumps(out)


def _gate(gate: Any, names: list[str], index: int) -> dict[str, Any]:
    show = names.index(gate.show) if gate.show else index - 1
    return {"t": gate.timeout_ms, "o": gate.on_timeout, "a": dumps(gate.approvers) if gate.approvers else "",
            "s": str(show), "n": names[index]}


def gate_keys(ledger: Ledger, spec: JobSpec, seq: int) -> list[str]:
    """The round-1 record keys of batch ``seq`` at every approval stage, in stage order."""
    k = ledger.keys.job(spec.job_id)
    return [k.approval(seq, i, 1) for i in sorted(spec.flow.gates())]


def _iso(ms: int | None) -> str | None:
    if not ms:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def _member(created_ms: int, approval_id: str) -> str:
    return f"{created_ms:013d}:{approval_id}"


class Approvals:
    """Approval records, their decisions and the tenant listing; one per Ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.r = ledger.r
        self.keys = ledger.keys
        self.resumers: list[Resumer] = []

    # -- records ---------------------------------------------------------------------------

    def record(self, ref: ApprovalRef) -> dict[str, str]:
        fields = self.r.hgetall(self.keys.job(ref.job_id).approval(ref.seq, ref.stage, ref.round))
        if not fields:
            raise NotFound(f"no approval {ref.id!r}")
        if not intact(fields):
            raise CorruptRecord(f"approval {ref.id} failed its checksum")
        return fields

    def owned(self, tenant: str, approval_id: str) -> tuple[ApprovalRef, dict[str, str]]:
        """The record of an approval of ``tenant``; 404 for another tenant's (the same answer as none)."""
        ref = ApprovalRef.parse(approval_id)
        try:
            rec = self.record(ref)
        except NotFound:
            raise NotFound(f"no approval {approval_id[:100]!r}") from None
        if rec.get("tenant") != tenant:
            raise NotFound(f"no approval {approval_id[:100]!r}")
        return ref, rec

    def view(self, rec: dict[str, str], batch: dict[str, str] | None = None) -> dict[str, Any]:
        """The public view of a record (and the batch it is about, for the items range and output)."""
        ref = ApprovalRef.parse(rec["id"])
        if batch is None:
            batch = self.r.hgetall(self.keys.job(ref.job_id).batch(ref.seq))
        shown = None
        if rec.get("kind") == "platform":
            shown = loads_or_none(rec.get("prompt") or "")
        elif rec.get("show", "") != "":
            shown = loads_or_none(batch.get(f"out:{rec['show']}", ""))
        decision = None
        if rec.get("decided_ms"):
            decision = {"decision": rec.get("decision") or None, "actor": rec.get("actor"),
                        "comment": rec.get("comment") or None, "decided_at": _iso(int(rec["decided_ms"])),
                        "edited_output": rec.get("edited") == "1"}
        return {
            "id": rec["id"], "job_id": ref.job_id, "seq": ref.seq, "stage": rec.get("stage_name"),
            "stage_index": ref.stage, "round": ref.round, "kind": rec.get("kind"), "status": rec["status"],
            "items": {"cursor": loads_or_none(batch.get("start_cursor", "")),
                      "end_cursor": loads_or_none(batch.get("end_cursor", "")),
                      "count": int(batch["n_items"]) if batch.get("n_items", "").isdigit() else None},
            "shown_output": shown, "prompt": loads_or_none(rec.get("prompt") or ""),
            "created": _iso(int(rec["created_ms"])), "deadline": _iso(int(rec["deadline_ms"])),
            "on_timeout": rec.get("on_timeout"),
            "approvers": json.loads(rec["approvers"]) if rec.get("approvers") else None,
            "decision": decision,
        }

    def get(self, tenant: str, approval_id: str) -> dict[str, Any]:
        _, rec = self.owned(tenant, approval_id)
        return self.view(rec)

    # -- the tenant's listing ----------------------------------------------------------------

    def file(self, tenant: str, approval_id: str, created_ms: int, status: str) -> None:
        """File an approval under ``status`` (and under no other listed status); void ones nowhere."""
        member = _member(created_ms, approval_id)
        pipe = multi(self.r)
        for s in LISTED:
            if s != status:
                pipe.zrem(self.keys.approval_index(tenant, s), member)
        if status in LISTED:
            pipe.zadd(self.keys.approval_index(tenant, status), {member: 0})
        pipe.execute()

    def _file_opened(self, tenant: str, job_id: str, approval_id: str) -> None:
        created = self.r.zscore(self.keys.job(job_id).approvals, approval_id)
        if created is not None:
            self.file(tenant, approval_id, int(created), "pending")

    def list(self, tenant: str, status: str = "pending", limit: int = 50,
             cursor: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the tenant's approvals in ``status``, newest first; (views, next cursor or None).

        Every record on the page is read again; one whose status moved (a lost index write) is filed
        where it belongs and left out; one whose job expired or was cancelled leaves the listing."""
        if status not in LISTED:
            raise InvalidRequest(f"status must be one of {', '.join(LISTED)}")
        key = self.keys.approval_index(tenant, status)
        after = self._decode_cursor(cursor, status) if cursor else None
        out: list[dict[str, Any]] = []
        last = after
        while len(out) < limit:
            hi = f"({last}" if last else "+"
            members = self.r.zrevrangebylex(key, hi, "-", start=0, num=limit - len(out))
            if not members:
                return out, None
            pipe = self.r.pipeline(transaction=False)
            refs = []
            for m in members:
                ref = ApprovalRef.parse(m.split(":", 1)[1])
                refs.append(ref)
                k = self.keys.job(ref.job_id)
                pipe.hgetall(k.approval(ref.seq, ref.stage, ref.round))
                pipe.hgetall(k.batch(ref.seq))
                pipe.hget(k.job, "status")
            got = pipe.execute()
            for i, (m, ref) in enumerate(zip(members, refs, strict=True)):
                rec, batch, job_status = got[3 * i], got[3 * i + 1], got[3 * i + 2]
                last = m
                if not rec or (job_status == "cancelled" and rec.get("status") == "pending"):
                    self.r.zrem(key, m)  # its job expired, or was cancelled: nobody can decide it
                    continue
                if rec.get("status") != status:
                    self.file(tenant, ref.id, int(rec["created_ms"]), rec.get("status", ""))
                    continue
                out.append(self.view(rec, batch))
        return out, self._encode_cursor(status, last) if last else None

    @staticmethod
    def _encode_cursor(status: str, member: str) -> str:
        raw = json.dumps({"s": status, "m": member}, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    @staticmethod
    def _decode_cursor(cursor: str, status: str) -> str:
        try:
            data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
            ok = isinstance(data, dict) and data.get("s") == status and isinstance(data.get("m"), str)
        except (ValueError, binascii.Error, UnicodeError):
            ok = False
        if not ok or ":" not in data["m"]:
            raise InvalidRequest("cursor is not one this listing made (or was made for another status)")
        return data["m"]

    # -- deciding ----------------------------------------------------------------------------

    def decide(self, tenant: str | None, approval_id: str, decision: str, actor: str,
               comment: str = "", output: Any = None, approver: str | None = None,
               mode: str = "person") -> tuple[dict[str, Any], bool]:
        """Decide an approval (decide.lua); returns (view, decided now). The same decision again answers
        the first record (False); another one raises ApprovalDecided (409). ``approver`` is who decides
        when the approval names approvers (the actor for a token, the link's name for a signed link);
        ``tenant`` None (the supervisor) skips the tenant wall and the approvers. ``mode`` "timeout"
        decides only past the deadline; "void" only records void an approval whose batch moved on."""
        if tenant is None:
            ref = ApprovalRef.parse(approval_id)
            rec = self.record(ref)
        else:
            ref, rec = self.owned(tenant, approval_id)
        allowed = json.loads(rec["approvers"]) if rec.get("approvers") else None
        if allowed is not None and tenant is not None and (approver or actor) not in allowed:
            raise Forbidden(f"{(approver or actor)[:100]} is not an approver of approval {ref.id}")
        spec = self.ledger.spec(ref.job_id)
        k = self.keys.job(ref.job_id)
        gates = sorted(spec.flow.gates())
        ready = self.ledger._ready_keys(spec)
        first_gate_key = 11 + len(ready)  # KEYS index of the first round-1 record key
        res = self.ledger.scripts.decide(
            keys=[k.job, k.batch(ref.seq), k.approval(ref.seq, ref.stage, ref.round), k.approvals,
                  k.approvals_due, k.items(ref.seq), k.leases, k.done, k.failed, k.log, *ready,
                  *[k.approval(ref.seq, i, 1) for i in gates], k.events],
            args=[decision, actor[:200], (comment or "")[:2000], "" if output is None else dumps(output),
                  mode, spec.stage_count, self.ledger.settings.log_maxlen,
                  spec.budget_total, spec.flow.tolerated_failure_percentage,
                  gates_arg(spec, first_gate_key), ref.job_id, spec.tenant])
        tag = res[0]
        if tag == "decided":
            status, first = res[1], res[2]
            wanted = "reject" if decision == "fail" else decision
            if status == "void" or first != wanted:
                raise ApprovalDecided(f"approval {ref.id} was decided already ({status}); a decision "
                                      "never changes", approval_status=status)
            return self.view(self.record(ref)), False
        if tag == "cancelled":
            raise JobCancelled(f"job {ref.job_id} is cancelled; its approvals can no longer be decided",
                               job_status="cancelled")
        if tag == "void":
            self.file(spec.tenant, ref.id, int(rec["created_ms"]), "void")
            raise ApprovalDecided(f"approval {ref.id} no longer applies: its batch is {res[1]} (the job "
                                  "was re-planned from a cursor)", approval_status="void")
        if tag in ("not_due", "held", "live"):
            raise Conflict(f"approval {ref.id} is not due for its timeout ({tag})")
        if tag == "missing":
            raise NotFound(f"no approval {approval_id[:100]!r}")
        if tag != "ok":
            raise CorruptRecord(f"approval {ref.id} or its job failed its checksum")
        self.file(spec.tenant, ref.id, int(rec["created_ms"]), res[1])
        if res[1] == "rejected":  # the batch failed for good with type rejected
            metrics.BATCHES_FAILED.labels(str(ref.stage), "rejected").inc()
        elif res[1] == "approved":
            metrics.BATCHES_COMMITTED.labels(str(ref.stage)).inc()
        if res[3]:
            self._file_opened(spec.tenant, ref.job_id, res[3])
        log.info("approval decided approval=%s job_id=%s seq=%s stage=%s decision=%s actor=%s job_status=%s",
                 ref.id, ref.job_id, ref.seq, ref.stage, decision, actor, res[2])
        view = self.view(self.record(ref))
        if rec.get("kind") == "platform":
            self._resume(view)
        return view, True

    def _resume(self, view: dict[str, Any]) -> None:
        for fn in list(self.resumers):
            try:
                fn(view, view["decision"] or {})
            except Exception:  # noqa: BLE001 - the decision stands; the next attempt asks the platform
                log.exception("approval resumer failed approval=%s", view["id"])

    # -- opening outside a commit ---------------------------------------------------------------

    def open_platform(self, job_id: str, seq: int, lease_token: str, prompt: Any,
                      platform: dict[str, Any] | None = None,
                      timeout_s: float | None = None) -> dict[str, Any]:
        """Turn a leased batch whose platform waits for a person into waiting_human (open_approval.lua)."""
        spec = self.ledger.spec(job_id)
        batch = self.ledger.batch_record(job_id, seq)
        stage = int(batch["stage"])
        rnd = int(batch.get(f"ap_n:{stage}") or 0)
        token_sum = _sha1(lease_token)
        current = self.r.hget(self.keys.job(job_id).approval(seq, stage, rnd), "token") if rnd else None
        if current != token_sum:
            rnd += 1  # a new wait; a retry by the same lease names the round it opened (first answer)
        timeout_ms = int((timeout_s or spec.flow.stages[stage].max_run.total_seconds()) * 1000)
        gate = {"t": max(1000, timeout_ms), "o": "reject", "a": "", "s": "",
                "n": spec.flow.stages[stage].name}
        res = self._open(spec, seq, stage, rnd, "leased", lease_token, gate,
                         "" if prompt is None else dumps(prompt), "" if platform is None else dumps(platform))
        self.ledger._raise_for(res, job_id, seq)
        if res[0] != "ok":
            raise Conflict(f"batch {seq} of job {job_id} could not wait for a person ({res[0]})")
        return {"approval_id": res[1], "deadline": _iso(int(res[2])), "job_status": res[3],
                "duplicate": res[4] == "1"}

    def open_ready(self, job_id: str) -> list[str]:
        """Open approvals for batches found in an approval stage's ready set (re-opened there)."""
        spec = self.ledger.spec(job_id)
        k = self.keys.job(job_id)
        opened = []
        for stage, gate in spec.flow.gates().items():
            for seq in self.r.zrange(k.ready(stage), 0, 99):
                batch = self.r.hgetall(k.batch(int(seq)))
                rnd = int(batch.get(f"ap_n:{stage}") or 0) + 1
                names = [s.name for s in spec.flow.stages]
                res = self._open(spec, int(seq), stage, rnd, "ready", "", _gate(gate, names, stage), "", "")
                if res[0] == "ok":
                    opened.append(res[1])
        return opened

    def _open(self, spec: JobSpec, seq: int, stage: int, rnd: int, mode: str, token: str,
              gate: dict[str, Any], prompt: str, platform: str) -> list:
        k = self.keys.job(spec.job_id)
        res = self.ledger.scripts.open_approval(
            keys=[k.job, k.batch(seq), k.approval(seq, stage, rnd), k.approvals, k.approvals_due, k.leases,
                  k.ready(stage), k.log, k.events],
            args=[mode, token, rnd, spec.job_id, spec.tenant, stage, dumps(gate), prompt, platform,
                  self.ledger.settings.log_maxlen, seq])
        if res[0] == "ok":
            self._file_opened(spec.tenant, spec.job_id, res[1])
            log.info("approval opened approval=%s job_id=%s seq=%s stage=%s", res[1], spec.job_id, seq, stage)
        return res

    # -- the supervisor's part -------------------------------------------------------------------

    def apply_timeouts(self, job_id: str) -> list[tuple[str, str]]:
        """Decide every approval of the job past its deadline as its on_timeout says; (id, outcome)."""
        due = self.r.zrangebyscore(self.keys.job(job_id).approvals_due, "-inf", int(time.time() * 1000))
        out = []
        for approval_id in due:
            ref = ApprovalRef.parse(approval_id)
            rec = self.record(ref)
            decision = TIMEOUT_DECISION.get(rec.get("on_timeout", ""), "reject")
            try:
                view, _ = self.decide(None, approval_id, decision, TIMEOUT_ACTOR,
                                      comment="timed out", mode="timeout")
                out.append((approval_id, view["status"]))
            except (ApprovalDecided, Conflict) as exc:
                log.info("approval timeout not applied approval=%s: %s", approval_id, exc.detail)
        return out

    def heal(self, job_id: str, tenant: str) -> int:
        """File pending approvals the listing lost (a crash between a script and its index write)."""
        k = self.keys.job(job_id)
        pending = self.r.zrange(k.approvals_due, 0, -1)
        if not pending:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for approval_id in pending:
            pipe.zscore(k.approvals, approval_id)
            pipe.hmget(k.batch(ApprovalRef.parse(approval_id).seq), "status", "approval")
        got = pipe.execute()
        created = got[0::2]
        for approval_id, (status, waits_on) in zip(pending, got[1::2], strict=True):
            if status is not None and (status != "waiting_human" or waits_on != approval_id):
                self._void(approval_id)  # its batch was re-planned (superseded): nobody decides it
        pipe = self.r.pipeline(transaction=False)
        key = self.keys.approval_index(tenant, "pending")
        for approval_id, c in zip(pending, created, strict=True):
            pipe.zscore(key, _member(int(c or 0), approval_id))
        missing = [(a, int(c or 0)) for a, c, s in zip(pending, created, pipe.execute(), strict=True)
                   if s is None]
        healed = 0
        for approval_id, c in missing:  # read again: a decision may have filed it meanwhile
            ref = ApprovalRef.parse(approval_id)
            if self.r.hget(k.approval(ref.seq, ref.stage, ref.round), "status") == "pending":
                self.file(tenant, approval_id, c, "pending")
                healed += 1
        return healed

    def _void(self, approval_id: str) -> None:
        """Record an approval whose batch no longer waits on it as void (decide.lua checks it again)."""
        try:
            self.decide(None, approval_id, "reject", "supervisor:replan", mode="void")
        except ApprovalDecided:
            pass  # void now (or decided meanwhile): either way out of the pending listing
        except Conflict as exc:
            log.info("approval not voided approval=%s: %s", approval_id, exc.detail)

    # -- signed decision links ---------------------------------------------------------------------

    def link_key(self) -> bytes:
        """The HMAC key of decision links: the configured signing key, else one kept in Redis."""
        configured = self.ledger.settings.signing_key
        if configured is not None:
            return configured.get_secret_value().encode()
        self.r.set(self.keys.decide_key, secrets.token_hex(32), nx=True)
        return self.r.get(self.keys.decide_key).encode()


class ApprovalOps:
    """The Ledger's approval operations for platform stages (mixed into Ledger, like ControlOps)."""

    approvals: Approvals

    def open_platform_approval(self, job_id: str, seq: int, lease_token: str, prompt: Any,
                               platform: dict[str, Any] | None = None,
                               timeout: timedelta | None = None) -> dict[str, Any]:
        """The leased batch's platform waits for a person: the batch becomes waiting_human with an
        approval showing ``prompt``, and its lease is released (open_approval.lua). ``platform``
        describes the run to resume once decided (a resumer's business; None = nothing to resume:
        approving commits the stage with the decision's output, else the prompt). ``timeout`` defaults
        to the stage's max_run; at the deadline the approval is rejected. A retry by the same lease
        answers the first approval (``duplicate``). StaleLease (409) if the token is not current."""
        return self.approvals.open_platform(job_id, seq, lease_token, prompt, platform,
                                            timeout.total_seconds() if timeout else None)

    def register_resumer(self, fn: Resumer) -> None:
        """Call ``fn(approval, decision)`` after every decision on a platform approval (both views as
        the API shows them), to continue the platform's run; see approvals.Resumer."""
        self.approvals.resumers.append(fn)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()
