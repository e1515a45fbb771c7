"""The ``batchgate`` command: up, serve, supervisor, jobs, flows."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import SettingsError

from gateway.ledger.embedded import DataDirInUse, NoLedgerRedis, connect
from gateway.runtime import cli_client
from gateway.settings import Settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    os.umask(0o077)  # data folder, AOF, logs, tokens and keys: readable by this user only
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        level = Settings().log_level.upper()
    except (ValidationError, SettingsError) as exc:  # e.g. flat BATCHGATE_SECRETS, a loose config file
        print(f"batchgate: invalid settings: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (NoLedgerRedis, DataDirInUse) as exc:
        print(f"batchgate: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgate", description=__doc__)
    sub = parser.add_subparsers(metavar="command")

    up = sub.add_parser("up", help="all-in-one: embedded Redis (unless BATCHGATE_REDIS_URL), API, "
                                   "supervisor, worker")
    up.add_argument("--port", type=int, default=None)
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="the API under gunicorn, on BATCHGATE_REDIS_URL or the Redis "
                                         "of a running up")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--workers", type=int, default=2)
    serve.set_defaults(func=cmd_serve)

    sup = sub.add_parser("supervisor", help="expire leases, recover crashed jobs, apply retention")
    sup.set_defaults(func=cmd_supervisor)

    reindex = sub.add_parser("reindex", help="rebuild the job index (listing by status, flow, time) "
                                             "from the job records; safe while jobs run")
    reindex.add_argument("--tenant", help="only this tenant (default: every tenant)")
    reindex.set_defaults(func=cmd_reindex)

    worker = sub.add_parser("worker", help="RQ worker (with RQ's scheduler) running push-mode stages")
    worker.add_argument("--burst", action="store_true",
                        help="exit once no job has work to start and nothing is in flight")
    worker.add_argument("--concurrency", type=int, default=None,
                        help="stage calls run at once in this process (threads; default "
                             "BATCHGATE_WORKER_CONCURRENCY, 1)")
    worker.set_defaults(func=cmd_worker)

    cli_client.add_commands(sub)
    return parser


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _watch(children: dict[str, subprocess.Popen], stop: threading.Event) -> bool:
    """Until ``stop`` is set; False as soon as a child exits (which it names on stderr)."""
    while not stop.is_set():
        for name, proc in children.items():
            if proc.poll() is not None:
                print(f"batchgate: the {name} exited with code {proc.returncode}; stopping the rest",
                      file=sys.stderr)
                return False
        stop.wait(0.2)
    return True


def cmd_up(args: argparse.Namespace) -> int:
    """Embedded Redis + API (gunicorn) + supervisor + worker, stopped together on Ctrl-C/SIGTERM.

    Nothing starts if the port is taken; if any child exits, the rest are stopped and ``up``
    exits 1. The embedded Redis is stopped last.
    """
    from gateway.runtime import procs

    settings = Settings()
    host, port = settings.host, args.port or settings.port
    try:
        held = procs.reserve_port(host, port)
    except OSError as exc:
        print(f"batchgate: port {port} on {host} is in use (another batchgate or another program): "
              f"{exc.strerror or exc}; choose another with --port or BATCHGATE_PORT", file=sys.stderr)
        return 2

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    embedded = None
    children: dict[str, subprocess.Popen] = {}
    env: dict[str, str] = {}
    try:
        if settings.redis_url is None:
            try:
                embedded = procs.start_embedded(settings)
            except DataDirInUse:
                raise
            except (RuntimeError, OSError) as exc:
                print(f"batchgate: the embedded Redis did not start: {exc}", file=sys.stderr)
                return 1
            redis_url = embedded.url
        else:
            redis_url = settings.redis_url.get_secret_value()
        tokens = procs.tokens_or_dev_token(settings)
        env = procs.child_env(settings, redis_url, tokens)
        env["BATCHGATE_PORT"] = str(port)
        env.setdefault("BATCHGATE_PUBLIC_URL", f"http://{host}:{port}")
        if stop.is_set():
            return 0
        for sock in held:
            sock.close()
        # tied: even a SIGKILL of `up` stops them
        children["API (gunicorn)"] = api = procs.start_api(env, host, port, tied=True)
        children["supervisor"] = procs.start_supervisor(env, tied=True)
        # sized for I/O (calls wait on platforms) unless BATCHGATE_WORKER_CONCURRENCY says otherwise
        children["worker"] = procs.start_worker(
            env, tied=True, concurrency=None if "worker_concurrency" in settings.model_fields_set
            else procs.UP_WORKER_CONCURRENCY)
        if embedded is not None:
            children["embedded redis-server"] = embedded.proc
        base = f"http://{host}:{port}"
        try:
            procs.wait_healthy(base, instance_id=env[procs.INSTANCE_ENV], proc=api, cancel=stop)
        except RuntimeError as exc:
            print(f"batchgate: {exc}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        print(f"batchgate: API on {base} (Ctrl-C stops everything)", flush=True)
        return 0 if _watch(children, stop) else 1
    finally:
        for sock in held:
            sock.close()
        # a second Ctrl-C must not cut the shutdown short
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        procs.stop_all(p for name, p in children.items() if not name.startswith("embedded"))
        if embedded is not None:
            embedded.stop()
        if env.get("BATCHGATE_CONFIG_FILE"):  # the children's credentials (procs.child_env)
            Path(env["BATCHGATE_CONFIG_FILE"]).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run gunicorn in the foreground (the Dockerfile's command); exits 2 if it has no Redis."""
    from gateway.runtime import procs

    settings = Settings()
    connect(settings)[0].close()  # NoLedgerRedis now, not once per gunicorn worker
    procs.tokens_or_dev_token(settings)  # gunicorn's workers read them through Settings.token_map()
    port = args.port or settings.port
    # gateway/runtime/gunicorn_conf.py: workers give the port back at once if this master is SIGKILLed, so
    # `serve` can be started again right away
    # no module from the current directory in gunicorn or its workers (procs.python, gunicorn_conf)
    os.environ.update(procs.safe_path_env(dict(os.environ)))
    command = [*procs.python("-m", "gunicorn"), "--config", procs.GUNICORN_CONF,
               "--bind", f"{settings.host}:{port}", "--workers", str(args.workers), "--threads", "4",
               "gateway.app:create_app()"]
    os.execv(command[0], command)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """A push worker (gateway/push/worker.py): --concurrency N stage calls at once, fed from the ledger, and a
    few RQ threads for polls; SIGTERM lets calls in flight finish within BATCHGATE_WORKER_GRACE."""
    _, settings = connect(Settings())  # NoLedgerRedis before anything else
    from gateway.runtime import procs

    procs.tie_forks_to_this_process()  # RQ's scheduler (a fork) dies with this process
    # dispatcher() reads the URL from the environment
    os.environ["BATCHGATE_REDIS_URL"] = settings.redis_url.get_secret_value()
    from gateway.push.dispatch import dispatcher
    from gateway.push.worker import PushWorker

    settings = Settings()
    concurrency = args.concurrency or settings.worker_concurrency
    if concurrency < 1:
        print("batchgate worker: --concurrency must be at least 1", file=sys.stderr)
        return 2
    worker = PushWorker(dispatcher().queue, concurrency, settings.worker_grace.total_seconds(),
                        logging_level=settings.log_level.upper())
    return worker.run(burst=args.burst)


def cmd_supervisor(args: argparse.Namespace) -> int:
    """Run the supervisor loop until SIGTERM/SIGINT."""
    client, settings = connect(Settings())  # NoLedgerRedis before anything else
    from gateway.ledger.ledger import Ledger
    from gateway.push import resumer
    from gateway.push.dispatch import Dispatcher
    from gateway.push.supervisor import Supervisor
    from gateway.runtime import procs

    procs.tie_forks_to_this_process()  # it forks nothing itself; whatever a library forks dies with it
    ledger = Ledger(client, settings)  # run() checks it (collation) once Redis answers: it may be down now
    dispatcher = Dispatcher.build(settings, ledger)
    resumer.install(dispatcher)  # timeouts decided here resume their platform runs too
    supervisor = Supervisor(ledger, dispatcher=dispatcher)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.stop.set())
    supervisor.run()
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    """Rebuild the job index (gateway/ledger/jobindex.py) and print what was filed, per tenant."""
    client, settings = connect(Settings())
    from gateway.ledger.ledger import Ledger

    index = Ledger(client, settings).index
    report = {args.tenant: index.rebuild(args.tenant)} if args.tenant else index.rebuild_all()
    for tenant, counts in report.items():
        print(f"{tenant}: {counts['filed']} jobs filed, {counts['gone']} expired jobs dropped, "
              f"{counts['stray_removed']} stray entries removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
