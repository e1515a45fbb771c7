"""CLI commands that talk to a running gateway over HTTP: jobs and flows."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import requests
import yaml

from gateway.settings import Settings

TERMINAL = ("succeeded", "failed", "cancelled")


class CliError(Exception):
    """A problem response or an unreachable gateway, worded for a terminal."""


class Client:
    """Bearer-authenticated JSON calls to the gateway."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base = base_url.rstrip("/")
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            resp = self.session.request(method, self.base + path, json=body, timeout=30)
        except requests.ConnectionError as exc:
            raise CliError(f"cannot reach batchgate at {self.base}: is `batchgate up` running?") from exc
        if resp.status_code == 204:
            return None
        data = resp.json() if resp.content else None
        if resp.status_code >= 400:
            detail = data.get("detail") if isinstance(data, dict) else resp.text
            raise CliError(f"{resp.status_code} {detail}")
        return data


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Attach ``jobs`` and ``flows`` to the top-level parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help="gateway URL (default BATCHGATE_PUBLIC_URL, else http://HOST:PORT)")
    common.add_argument("--token", default=None, help="bearer token (default $BATCHGATE_TOKEN)")

    jobs = sub.add_parser("jobs", help="list, show, pause, resume, cancel, release, migrate jobs")
    jsub = jobs.add_subparsers(metavar="action", required=True)
    ls = jsub.add_parser("list", parents=[common])
    ls.add_argument("--status")
    ls.add_argument("--flow", help="only jobs of this flow (FLOW or FLOW@VERSION)")
    ls.add_argument("--since", help="created at or after (epoch ms or ISO 8601)")
    ls.add_argument("--until", help="created before (epoch ms or ISO 8601)")
    ls.add_argument("--oldest", action="store_true", help="oldest first")
    ls.add_argument("--limit", type=int, default=100, help="jobs per page (1-1000)")
    ls.add_argument("--all", action="store_true", help="follow every page (else: the first, and a hint)")
    ls.set_defaults(func=jobs_list)
    show = jsub.add_parser("show", parents=[common])
    show.add_argument("job_id")
    show.add_argument("--watch", action="store_true", help="live progress bar until the job ends")
    show.set_defaults(func=jobs_show)
    for action in ("pause", "cancel", "retry-failed", "release"):
        p = jsub.add_parser(action, parents=[common])
        p.add_argument("job_id")
        p.set_defaults(func=jobs_action, action=action)
    resume = jsub.add_parser("resume", parents=[common])
    resume.add_argument("job_id")
    resume.add_argument("--cursor", help="JSON cursor to re-plan from (rewind, or skip a bad range)")
    resume.add_argument("--reason", default="")
    resume.set_defaults(func=jobs_resume)
    migrate = jsub.add_parser("migrate", parents=[common],
                              help="move a paused or failed job to another version of its flow")
    migrate.add_argument("job_id")
    migrate.add_argument("--flow-version", required=True, help="the version to move to")
    migrate.add_argument("--reason", required=True, help="why (kept in the job's audit trail)")
    migrate.set_defaults(func=jobs_migrate)

    flows = sub.add_parser("flows", help="apply flow definitions")
    fsub = flows.add_subparsers(metavar="action", required=True)
    apply = fsub.add_parser("apply", parents=[common])
    apply.add_argument("-f", "--file", action="append", required=True, type=Path,
                       help="YAML or JSON file (one flow, or a list); repeatable")
    apply.set_defaults(func=flows_apply)


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def default_token(settings: Settings) -> str | None:
    """BATCHGATE_TOKEN, else the all-in-one's development token if one exists."""
    token = os.environ.get("BATCHGATE_TOKEN")
    if token:
        return token
    return settings.dev_token()


def client_from(args: argparse.Namespace) -> Client:
    settings = Settings()
    url = args.url or settings.base_url()  # BATCHGATE_PUBLIC_URL, else http://HOST:PORT
    return Client(url, args.token or default_token(settings))


def _run(fn):
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args) or 0
        except CliError as exc:
            print(f"batchgate: {exc}", file=sys.stderr)
            return 1
    return wrapped


@_run
def jobs_list(args: argparse.Namespace) -> int:
    flow_id, _, version = (args.flow or "").partition("@")
    params = {"status": args.status, "flow_id": flow_id or None, "flow_version": version or None,
              "created_after": args.since, "created_before": args.until,
              "order": "oldest" if args.oldest else None, "limit": args.limit}
    client = client_from(args)
    path: str | None = "/v1/jobs?" + urlencode({k: v for k, v in params.items() if v is not None})
    while path:
        page = client.call("GET", path)
        for job in page["jobs"]:
            print(f"{job['job_id']}  {job['status']:<10} {job['flow']['id']}@{job['flow']['version']}  "
                  f"{job['items_done']} items, {job['batches']['completed']}/{job['batches']['planned']} "
                  "batches")
        path = page.get("next")
        if path and not args.all:
            print(f"(more: --all, or GET {path})", file=sys.stderr)
            break
    return 0


@_run
def jobs_show(args: argparse.Namespace) -> int:
    client = client_from(args)
    if not args.watch:
        print_json(client.call("GET", f"/v1/jobs/{args.job_id}"))
        return 0
    job = watch(client, args.job_id)
    return 0 if job["status"] == "succeeded" else 1


def watch(client: Client, job_id: str, interval_s: float = 0.5, stream=sys.stdout) -> dict:
    """Redraw a progress bar until the job reaches a terminal status; returns the final view."""
    while True:
        job = client.call("GET", f"/v1/jobs/{job_id}")
        stream.write("\r" + progress_line(job))
        stream.flush()
        if job["status"] in TERMINAL:
            stream.write("\n")
            return job
        time.sleep(interval_s)


def progress_line(job: dict, width: int = 30) -> str:
    """``[#####.....]  52.0% 260/500 items  ETA 20s  ...  running``; files: ``1.2/2.3 MB, 260 items``.

    No bar when neither the item count nor the source's size in bytes is known.
    """
    done, total = job["items_done"], job.get("items_total")
    batches = job["batches"]
    tail = (f"{batches['completed']}/{batches['planned']} batches  "
            f"{job['rate_items_per_s']:.1f} items/s  {job['status']:<10}")
    if total:
        frac, amount = min(done / total, 1.0), f"{done}/{total} items"
    elif job.get("progress") is not None and job.get("bytes_total"):
        frac = min(job["progress"], 1.0)
        amount = f"{_mb(job.get('bytes_done') or 0)}/{_mb(job['bytes_total'])} MB, {done} items"
    else:
        return f"{done} items  {tail}"
    bar = "#" * int(frac * width) + "." * (width - int(frac * width))
    eta = f"ETA {job['eta_s']:.0f}s" if job.get("eta_s") is not None else "ETA -"
    return f"[{bar}] {frac * 100:5.1f}% {amount}  {eta}  {tail}"


def _mb(n: int) -> str:
    return f"{n / 1_000_000:.1f}"


@_run
def jobs_action(args: argparse.Namespace) -> int:
    print_json(client_from(args).call("POST", f"/v1/jobs/{args.job_id}/{args.action}"))
    return 0


@_run
def jobs_resume(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"reason": args.reason}
    if args.cursor is not None:
        try:
            body["cursor"] = json.loads(args.cursor)
        except ValueError as exc:
            raise CliError(f"--cursor is not JSON: {exc}") from exc
    print_json(client_from(args).call("POST", f"/v1/jobs/{args.job_id}/resume", body))
    return 0


@_run
def jobs_migrate(args: argparse.Namespace) -> int:
    body = {"flow_version": args.flow_version, "reason": args.reason}
    print_json(client_from(args).call("POST", f"/v1/jobs/{args.job_id}/migrate", body))
    return 0


@_run
def flows_apply(args: argparse.Namespace) -> int:
    client = client_from(args)
    for path in args.file:
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise CliError(f"{path}: {exc}") from exc
        for flow in loaded if isinstance(loaded, list) else [loaded]:
            record = client.call("POST", "/v1/flows", flow)
            print(f"{path}: flow {record['flow']['id']}@{record['flow']['version']} {record['hash'][:12]}")
    return 0
