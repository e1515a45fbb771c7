"""The CLI commands that talk to a running gateway over HTTP (flows, jobs), built on gateway/client.py.

They need no server settings: the gateway is found by --url/--token, BATCHGATE_URL/BATCHGATE_TOKEN, else
the `batchgate up` running here (Client.discover). A problem answer prints its detail and each of its
``errors[]`` (exit 1); an unreachable gateway says where it looked.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml

from gateway.client import TERMINAL, Client, Problem, Unreachable

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100, "terminal_width": 100}
STATUSES = ("running", "paused", "held", "waiting_human", "succeeded", "failed", "cancelled")
BATCH_STATUSES = ("pending", "leased", "completed", "failed", "superseded", "waiting_human")


def connection_options(fn):
    """--url and --token on every HTTP command."""
    fn = click.option("--token", default=None, envvar="BATCHGATE_TOKEN", show_envvar=True,
                      help="bearer token (default: the dev token of the `up` running here)")(fn)
    fn = click.option("--url", default=None, envvar="BATCHGATE_URL", show_envvar=True,
                      help="gateway URL (default: the `up` running here, else http://127.0.0.1:8080)")(fn)
    return fn


def http_command(group: click.Group, name: str | None = None, **kwargs):
    """A command of ``group`` that gets a ``client`` and turns problems into messages and exit 1."""
    def wrap(fn):
        @group.command(name, context_settings=CONTEXT, **kwargs)
        @connection_options
        @functools.wraps(fn)
        def command(url: str | None, token: str | None, **params: Any) -> int:
            client = Client.discover(url=url, token=token)
            try:
                return fn(client, **params) or 0
            except Problem as exc:
                click.echo(f"batchgate: {exc}", err=True)
                if exc.status == 401:
                    click.echo(f"batchgate: {_token_hint(client)}", err=True)
                return 1
            except Unreachable as exc:
                where = client.found.url_from if client.found else "--url"
                click.echo(f"batchgate: {exc}; the address came from {where}. Is `batchgate up` (or "
                           "serve) running? Set --url or BATCHGATE_URL otherwise.", err=True)
                return 1
        return command
    return wrap


def _token_hint(client: Client) -> str:
    found = client.found
    if found is None or found.token_from is None:
        return ("no token was sent: set BATCHGATE_TOKEN or --token (a `batchgate up` started without "
                "BATCHGATE_TOKENS keeps a development token in its data dir, found automatically)")
    return f"the token came from {found.token_from}; is it one of the gateway's BATCHGATE_TOKENS?"


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def json_or_file(value: str | None, what: str) -> Any:
    """``'{"a": 1}'`` or ``@path`` (JSON or YAML) -> the value; a clear error for bad input."""
    if value is None:
        return None
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=what) from None
        try:
            return yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise click.BadParameter(f"{path} is not valid: {exc}", param_hint=what) from None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc}); give JSON or @file", param_hint=what) from None


def flow_ref(value: str) -> tuple[str, str | None]:
    flow_id, _, version = value.partition("@")
    return flow_id, version or None


# -- flows -----------------------------------------------------------------------------------------

@click.group(context_settings=CONTEXT)
def flows() -> None:
    """Register, list and show flow definitions (YAML or JSON)."""


@http_command(flows, "apply")
@click.option("-f", "--file", "files", multiple=True, required=True, type=click.Path(path_type=Path),
              help="YAML or JSON file (one flow, or a list); repeatable")
def flows_apply(client: Client, files: tuple[Path, ...]) -> int:
    """Register every flow in the files (an identical version again is fine; a changed one is refused)."""
    for path in files:
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise click.BadParameter(f"{path}: {exc}", param_hint="--file") from None
        for flow in loaded if isinstance(loaded, list) else [loaded]:
            record = client.apply_flow(flow)
            click.echo(f"{path}: flow {record['flow']['id']}@{record['flow']['version']} "
                       f"{record['hash'][:12]}")
    return 0


@http_command(flows, "list")
def flows_list(client: Client) -> int:
    """Every version of every flow of your tenant."""
    records = client.flows()
    if not records:
        click.echo("no flows yet: batchgate flows apply -f flow.yaml", err=True)
    for record in records:
        stages = ", ".join(s["name"] for s in record["flow"]["stages"])
        click.echo(f"{record['flow']['id']}@{record['flow']['version']}  {record['hash'][:12]}  {stages}")
    return 0


@http_command(flows, "show")
@click.argument("flow")
def flows_show(client: Client, flow: str) -> int:
    """FLOW or FLOW@VERSION as JSON (the latest version without one)."""
    print_json(client.flow(*flow_ref(flow)))
    return 0


# -- jobs ------------------------------------------------------------------------------------------

@click.group(context_settings=CONTEXT)
def jobs() -> None:
    """Create, list, watch and steer jobs."""


@http_command(jobs, "create")
@click.option("--flow", "flow", required=True, metavar="ID[@VERSION]", help="the flow (latest version if none)")
@click.option("--source", default=None, metavar="JSON|@FILE", help="the job's source (else the flow's)")
@click.option("--params", default=None, metavar="JSON|@FILE", help="params every stage receives")
@click.option("--sink", default=None, metavar="JSON|@FILE",
              help='where committed outputs go, else the flow\'s: {"type": "s3", "bucket": ..., '
              '"prefix": ...}, jsonl/csv with a path, http with a url, discard')
@click.option("--idempotency-key", default=None, help="the same key and body again returns the same job")
@click.option("--watch", is_flag=True, help="then show progress until the job ends (exit 1 unless it succeeds)")
def jobs_create(client: Client, flow: str, source: str | None, params: str | None, sink: str | None,
                idempotency_key: str | None, watch: bool) -> int:
    """Start a job; prints its id (and, with --watch, its progress)."""
    flow_id, version = flow_ref(flow)
    job = client.create_job(flow_id, version, json_or_file(params, "--params"),
                            json_or_file(source, "--source"), idempotency_key, json_or_file(sink, "--sink"))
    click.echo(job["job_id"])
    if not watch:
        return 0
    final = watch_job(client, job["job_id"])
    return 0 if final["status"] == "succeeded" else 1


@http_command(jobs, "plan")
@click.option("--flow", "flow", required=True, metavar="ID[@VERSION]",
              help="the flow (latest version if none)")
@click.option("--source", default=None, metavar="JSON|@FILE", help="the job's source (else the flow's)")
@click.option("--params", default=None, metavar="JSON|@FILE", help="params every stage receives")
@click.option("--json", "as_json", is_flag=True, help="the whole plan as JSON")
def jobs_plan(client: Client, flow: str, source: str | None, params: str | None, as_json: bool) -> int:
    """Plan a job without running it: batches, calls per stage, expected duration and cost, and how sure
    each figure is. Reads the source; creates no job and calls no platform."""
    flow_id, version = flow_ref(flow)
    plan = client.plan_job(flow_id, version, json_or_file(params, "--params"),
                           json_or_file(source, "--source"))
    return _show(plan, as_json, plan_lines)


def _show(value: dict[str, Any], as_json: bool, lines: Callable[[dict[str, Any]], list[str]]) -> int:
    """A command's answer: the JSON with ``--json``, else the lines a person reads."""
    if as_json:
        print_json(value)
        return 0
    for line in lines(value):
        click.echo(line)
    return 0


def _figure(value: Any, unit: str = "") -> str:
    if value is None:
        return "unknown"
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """A dry run, as a person reads it."""
    cost = plan["cost"]
    lines = [f"batches   {_figure(plan['batches'])} ({plan['batches_confidence']}"
             + (f": {plan['batches_why']}" if plan.get("batches_why") else "") + ")"]
    for stage in plan["stages"]:
        call = _figure(stage["call_seconds"], " s")
        lines.append(f"  {stage['stage']:<16} {_figure(stage['calls'])} calls, {stage['parallel']} at once, "
                     f"{call} per call ({stage['call_seconds_confidence']}, "
                     f"{stage['call_seconds_samples']} samples)")
    lines.append(f"duration  {_figure(plan['duration_s'], ' s')} ({plan['duration_confidence']})")
    lines.append(f"cost      {_figure(cost['tokens'])} tokens, price {_figure(cost['price'])} "
                 f"({cost['confidence']})")
    return lines


@http_command(jobs, "cost")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="the cost section as JSON")
def jobs_cost(client: Client, job_id: str, as_json: bool) -> int:
    """What a job's calls cost: calls, paid calls, calls redone after a lost worker or callback and what
    they cost, tokens, price; per stage."""
    return _show(client.cost(job_id), as_json, cost_lines)


def cost_lines(cost: dict[str, Any]) -> list[str]:
    """A job's cost section, as a person reads it: the job, then each stage."""
    currency = f" {cost['currency']}" if cost.get("currency") else ""

    def line(name: str, c: dict[str, Any]) -> str:
        redone = c["redone"]
        price = "" if c["price"] is None else f", price {c['price']:g}{currency}"
        crash = (f"; redone {redone['calls']} ({redone['tokens']} tokens"
                 + ("" if redone["price"] is None else f", {redone['price']:g}{currency}") + ")"
                 if redone["calls"] else "")
        return (f"{name:<18} {c['calls']} calls ({c['paid_calls']} paid), {c['tokens']} tokens{price}, "
                f"{c['call_seconds']:g} s{crash}")

    lines = [line("job", cost)]
    lines += [line(f"  {name}", c) for name, c in cost.get("stages", {}).items()]
    budget = cost.get("budget")
    if budget:
        paused = f"; paused: {budget['paused']}" if budget.get("paused") else ""
        lines.append(f"budget             tokens {_figure(budget['tokens'])}, "
                     f"price {_figure(budget['price'])}{paused}")
    return lines


@http_command(jobs, "list")
@click.option("--status", type=click.Choice(STATUSES), default=None)
@click.option("--flow", default=None, metavar="ID[@VERSION]", help="only jobs of this flow")
@click.option("--since", default=None, help="created at or after (epoch ms or ISO 8601)")
@click.option("--until", default=None, help="created before (epoch ms or ISO 8601)")
@click.option("--oldest", is_flag=True, help="oldest first")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True, help="jobs per page")
@click.option("--all", "all_pages", is_flag=True, help="follow every page (else the first, and a hint)")
def jobs_list(client: Client, status: str | None, flow: str | None, since: str | None, until: str | None,
              oldest: bool, limit: int, all_pages: bool) -> int:
    """Your tenant's jobs, newest first: id, status, flow, items and batches done."""
    flow_id, version = flow_ref(flow) if flow else (None, None)
    page = client.jobs_page(status=status, flow_id=flow_id, flow_version=version, created_after=since,
                            created_before=until, order="oldest" if oldest else None, limit=limit)
    shown = 0
    while True:
        for job in page.items:
            click.echo(job_line(job))
            shown += 1
        if not page.next:
            break
        if not all_pages:
            click.echo(f"(more: --all, or GET {page.next})", err=True)
            break
        page = client.jobs_page(cursor_path=page.next)
    if not shown:
        click.echo("no jobs" + (" with these filters" if any((status, flow, since, until)) else ""), err=True)
    return 0


def job_line(job: dict[str, Any]) -> str:
    status = job["status"]
    waiting = job.get("waiting")
    if waiting:  # batches waiting on an unavailable platform: not plain running
        status += f" (waiting: {waiting.get('target') or 'target'} {waiting.get('reason')})"
    return (f"{job['job_id']}  {status:<10} {job['flow']['id']}@{job['flow']['version']}  "
            f"{job['items_done']} items, {job['batches']['completed']}/{job['batches']['planned']} batches")


@http_command(jobs, "show")
@click.argument("job_id")
@click.option("--watch", is_flag=True, help="a live progress bar until the job ends (exit 1 unless it succeeds)")
def jobs_show(client: Client, job_id: str, watch: bool) -> int:
    """One job as JSON: status, committed cursor, batch counts, progress, errors."""
    if not watch:
        print_json(client.job(job_id))
        return 0
    final = watch_job(client, job_id)
    return 0 if final["status"] == "succeeded" else 1


@http_command(jobs, "batches")
@click.argument("job_id")
@click.option("--status", type=click.Choice(BATCH_STATUSES),
              default=None)
@click.option("--after", type=int, default=-1, help="batches after this seq")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              help="batches at most")
def jobs_batches(client: Client, job_id: str, status: str | None, after: int, limit: int) -> int:
    """Batch summaries in seq order: status, stage, attempts, error."""
    rows = client.batches(job_id, status=status, after=after, limit=limit)
    if not rows:
        click.echo("no batches" + (f" {status}" if status else ""), err=True)
    for b in rows:
        if b.get("compacted"):  # delivered to the job's result sink: one row stands for the range
            click.echo(f"#{b['first_seq']}-{b['last_seq']:<6} {b['status']:<10} delivered to the sink, "
                       f"{b['batches_completed']} batches, {b['items']} items")
            continue
        error = f"  {b.get('error_type') or ''} {b['error']}" if b.get("error") else ""
        click.echo(f"#{b['seq']:<6} {b['status']:<10} stage {b.get('stage') or '-':<12} "
                   f"attempt {b.get('attempt', 0)}{error}")
    return 0


def _entries(fetch, job_id: str, limit: int, follow: bool) -> None:
    after = None
    while True:
        entries = fetch(job_id, after=after, limit=limit)
        for e in entries:
            fields = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                              for k, v in e.items() if k not in ("id", "at_ms", "at", "event"))
            click.echo(f"{e.get('at', e['id'])}  {e.get('event', ''):<18} {fields}")
            after = e["id"]
        if not follow:
            return
        time.sleep(1.0)


@http_command(jobs, "log")
@click.argument("job_id")
@click.option("--limit", type=click.IntRange(1, 10_000), default=200, show_default=True,
              help="entries per request")
@click.option("--follow", "-f", is_flag=True, help="keep printing new entries (Ctrl-C to stop)")
def jobs_log(client: Client, job_id: str, limit: int, follow: bool) -> int:
    """The execution log: planned, stage started and completed, retries, failures..."""
    _entries(client.log, job_id, limit, follow)
    return 0


@http_command(jobs, "audit")
@click.argument("job_id")
@click.option("--limit", type=click.IntRange(1, 10_000), default=200, show_default=True,
              help="entries at most")
def jobs_audit(client: Client, job_id: str, limit: int) -> int:
    """Control events with actor, reason and time: created, paused, resumed, cursor moved, migrated..."""
    _entries(client.audit, job_id, limit, False)
    return 0


def _action(name: str, doc: str, call) -> None:
    @http_command(jobs, name, help=doc)
    @click.argument("job_id")
    def command(client: Client, job_id: str) -> int:
        print_json(call(client, job_id))
        return 0


_action("pause", "Hand out no new batches (batches in flight may still finish).", Client.pause)
_action("retry-failed", "Re-open failed batches (a failed job runs again).", Client.retry_failed)
_action("release", "Let a held job (record-only recovery) run again.", Client.release)


@http_command(jobs, "quarantine")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="the listing as JSON, items included")
def jobs_quarantine(client: Client, job_id: str, as_json: bool) -> int:
    """Items bisection set apart (stages with on_fatal: bisect): id, stage, the platform's error."""
    listing = client.quarantine(job_id)
    if as_json:
        print_json(listing)
        return 0
    if not listing["items"]:
        click.echo("no quarantined items", err=True)
    for q in listing["items"]:
        click.echo(f"{q['id']:<12} stage {q['stage']:<12} {q.get('error_type') or ''} {q['error']}".rstrip())
    return 0


@http_command(jobs, "retry-quarantined")
@click.argument("job_id")
@click.argument("item_ids", nargs=-1, metavar="[ITEM_ID]...")
def jobs_retry_quarantined(client: Client, job_id: str, item_ids: tuple[str, ...]) -> int:
    """Run quarantined items again (ids as `jobs quarantine` lists them, <seq>.<index>; none: all)."""
    print_json(client.retry_quarantined(job_id, list(item_ids) or None))
    return 0


@http_command(jobs, "cancel")
@click.argument("job_id")
@click.option("--reason", default=None, help="kept in the audit trail")
def jobs_cancel(client: Client, job_id: str, reason: str | None) -> int:
    """Final: voids every lease; answers that came later change nothing."""
    print_json(client.cancel(job_id, reason))
    return 0


@http_command(jobs, "resume")
@click.argument("job_id")
@click.option("--cursor", default=None, metavar="JSON|@FILE", help="re-plan from this cursor (rewind, skip)")
@click.option("--reason", default=None, help="kept in the audit trail")
def jobs_resume(client: Client, job_id: str, cursor: str | None, reason: str | None) -> int:
    """Run a paused, failed or held job again (with --cursor: from that cursor)."""
    print_json(client.resume(job_id, json_or_file(cursor, "--cursor"), reason))
    return 0


@http_command(jobs, "migrate")
@click.argument("job_id")
@click.option("--flow-version", required=True, help="the version of the job's flow to move to")
@click.option("--reason", required=True, help="why (kept in the job's audit trail)")
def jobs_migrate(client: Client, job_id: str, flow_version: str, reason: str) -> int:
    """Move a paused or failed job to another version of its flow (stages in use must stay)."""
    print_json(client.migrate(job_id, flow_version, reason))
    return 0


# -- approvals -------------------------------------------------------------------------------------

@click.group(context_settings=CONTEXT)
def approvals() -> None:
    """Batches waiting for a person: list, show, approve, reject."""


@http_command(approvals, "list")
@click.option("--status", type=click.Choice(["pending", "approved", "rejected"]), default="pending",
              show_default=True)
@click.option("--all", "all_pages", is_flag=True, help="follow every page")
def approvals_list(client: Client, status: str, all_pages: bool) -> int:
    """Your tenant's approvals, newest first: id, job, batch, stage, deadline."""
    page = client.approvals_page(status)
    shown = 0
    while True:
        for a in page.items:
            click.echo(f"{a['id']}  {a['status']:<9} job {a['job_id']} batch #{a['seq']} stage {a['stage']}"
                       f"  deadline {a.get('deadline') or '-'}")
            shown += 1
        if not page.next or not all_pages:
            if page.next:
                click.echo(f"(more: --all, or GET {page.next})", err=True)
            break
        page = client.approvals_page(cursor_path=page.next)
    if not shown:
        click.echo(f"no {status} approvals", err=True)
    return 0


@http_command(approvals, "show")
@click.argument("approval_id")
def approvals_show(client: Client, approval_id: str) -> int:
    """One approval as JSON: the batch, the output shown for review, prompt, approvers, decision."""
    print_json(client.approval(approval_id))
    return 0


@http_command(approvals, "approve")
@click.argument("approval_id")
@click.option("--comment", default=None, help="kept with the decision")
@click.option("--output", default=None, metavar="JSON|@FILE", help="an edited output that replaces the shown one")
def approvals_approve(client: Client, approval_id: str, comment: str | None, output: str | None) -> int:
    """Approve: the stage commits (the edited output if given) and the batch goes on."""
    print_json(client.approve(approval_id, comment, json_or_file(output, "--output")))
    return 0


@http_command(approvals, "reject")
@click.argument("approval_id")
@click.option("--comment", default=None, help="kept with the decision")
def approvals_reject(client: Client, approval_id: str, comment: str | None) -> int:
    """Reject: the batch fails with type rejected; the failure budget decides the job."""
    print_json(client.reject(approval_id, comment))
    return 0


# -- progress --------------------------------------------------------------------------------------

class ProgressBar:
    """A job's progress as a tqdm bar, redrawn from each job view given to :meth:`update`.

    Items when the total is known (sequences, inline lists, files once read to the end); bytes of the
    file read when only the size is (jsonl/csv); a count and a rate otherwise (URL sources)."""

    def __init__(self, label: str, stream=None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.bar = None
        self.unit: str | None = None

    def update(self, job: dict[str, Any]) -> None:
        from tqdm import tqdm

        total, done, unit = _measure(job)
        if self.bar is None or unit != self.unit:
            self.close()
            self.unit = unit
            self.bar = tqdm(total=total, unit=unit, unit_scale=unit == "B", file=self.stream,
                            dynamic_ncols=True, leave=True, desc=self.label, mininterval=0)
        self.bar.total = total
        self.bar.set_postfix_str(_postfix(job, unit), refresh=False)
        if done >= self.bar.n:
            self.bar.update(done - self.bar.n)  # tqdm's rate and ETA follow what moved, and when
        else:  # a rewind: the count starts over
            self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def watch_job(client: Client, job_id: str, interval_s: float = 0.5, stream=None) -> dict[str, Any]:
    """A progress bar until the job ends; returns the final view."""
    bar = ProgressBar(job_id[-8:], stream)
    try:
        while True:
            job = client.job(job_id)
            bar.update(job)
            if job["status"] in TERMINAL:
                return job
            time.sleep(interval_s)
    finally:
        bar.close()


def _measure(job: dict[str, Any]) -> tuple[float | None, float, str]:
    """(total, done, unit): a file's bytes from start to end (one unit for the whole run, so the
    bar never jumps when the item count becomes known), else items, with their total if known."""
    if job.get("bytes_total"):
        done = job.get("bytes_done") or 0
        if job.get("bytes_read") and job.get("items_planned"):  # batches done out of order count too
            done = max(done, int(job["bytes_read"] * min(job["items_done"] / job["items_planned"], 1.0)))
        return job["bytes_total"], done, "B"
    return job.get("items_total") or None, job["items_done"], "items"


def _postfix(job: dict[str, Any], unit: str | None = None) -> str:
    b = job["batches"]
    parts = [job["status"], f"{b['completed']}/{b['planned']} batches"]
    if unit == "B":
        parts.insert(1, f"{job['items_done']} items")
    if b.get("failed"):
        parts.append(f"{b['failed']} failed")
    if job.get("waiting"):
        parts.append(f"waiting: {job['waiting'].get('reason')}")
    return ", ".join(parts)


def register(root: click.Group) -> None:
    root.add_command(flows)
    root.add_command(jobs)
    root.add_command(approvals)
