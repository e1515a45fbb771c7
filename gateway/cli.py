"""The ``batchgate`` command: up, serve, supervisor, jobs, flows."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from gateway import cli_client
from gateway.embedded import connect, embedded_url
from gateway.settings import Settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=Settings().log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return args.func(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgate", description=__doc__)
    sub = parser.add_subparsers(metavar="command")

    up = sub.add_parser("up", help="all-in-one: embedded Redis (unless BATCHGATE_REDIS_URL), API, supervisor")
    up.add_argument("--port", type=int, default=None)
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="the API under gunicorn")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--workers", type=int, default=2)
    serve.set_defaults(func=cmd_serve)

    sup = sub.add_parser("supervisor", help="expire leases, recover crashed jobs, apply retention")
    sup.set_defaults(func=cmd_supervisor)

    worker = sub.add_parser("worker", help="RQ worker (with RQ's scheduler) running push-mode stages")
    worker.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    worker.set_defaults(func=cmd_worker)

    cli_client.add_commands(sub)
    return parser


def _serve_forever(procs: list, cleanup) -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.is_set():
            if any(p.poll() is not None for p in procs):
                print("batchgate: a child process exited; stopping", file=sys.stderr)
                break
            stop.wait(0.5)
    finally:
        cleanup()


def cmd_up(args: argparse.Namespace) -> int:
    """Embedded Redis + API (gunicorn) + supervisor, stopped together on Ctrl-C."""
    from gateway import procs

    settings = Settings()
    client, embedded = connect(settings)
    tokens = settings.token_map()
    if not tokens:
        tokens = {procs.dev_token(settings.data_dir): "default"}
        print(f"batchgate: no BATCHGATE_TOKENS set; a development token for tenant 'default' is in "
              f"{(settings.data_dir / procs.TOKEN_FILE).resolve()}")
    redis_url = (settings.redis_url or embedded_url(client)).get_secret_value()
    port = args.port or settings.port
    env = procs.child_env(settings, redis_url, tokens)
    env["BATCHGATE_PORT"] = str(port)
    env.setdefault("BATCHGATE_PUBLIC_URL", f"http://{settings.host}:{port}")
    api = procs.start_api(env, settings.host, port)
    sup = procs.start_supervisor(env)
    worker = procs.start_worker(env)

    def cleanup() -> None:
        procs.stop(api)
        procs.stop(sup)
        procs.stop(worker)
        if embedded:
            embedded.stop()

    try:
        procs.wait_healthy(f"http://{settings.host}:{port}")
    except RuntimeError:
        cleanup()
        raise
    print(f"batchgate: API on http://{settings.host}:{port} (Ctrl-C stops everything)")
    _serve_forever([api, sup, worker], cleanup)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run gunicorn in the foreground (the Dockerfile's command)."""
    settings = Settings()
    port = args.port or settings.port
    os.execvp(sys.executable, [sys.executable, "-m", "gunicorn", "--bind", f"{settings.host}:{port}",
                               "--workers", str(args.workers), "--threads", "4",
                               "gateway.app:create_app()"])
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """One RQ worker on the batchgate queue, JSON serializer, scheduler on."""
    from rq import Worker
    from rq.serializers import JSONSerializer

    from gateway.dispatch import dispatcher

    d = dispatcher()
    worker = Worker([d.queue], connection=d.queue.connection, serializer=JSONSerializer)
    worker.work(with_scheduler=True, burst=args.burst, logging_level=Settings().log_level.upper())
    return 0


def cmd_supervisor(args: argparse.Namespace) -> int:
    """Run the supervisor loop until SIGTERM/SIGINT."""
    from gateway.ledger import Ledger
    from gateway.supervisor import Supervisor

    settings = Settings()
    client, embedded = connect(settings)
    from gateway.dispatch import Dispatcher

    ledger = Ledger(client, settings)
    ledger.check_digest_agreement()
    if settings.redis_url is None:
        settings = settings.model_copy(update={"redis_url": embedded_url(client)})
    supervisor = Supervisor(ledger, dispatcher=Dispatcher.build(settings, ledger))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.stop.set())
    try:
        supervisor.run()
    finally:
        if embedded:
            embedded.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
