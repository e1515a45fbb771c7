"""batchgate: checkpoint-and-resume for long batch jobs on n8n, Dify and Coze.

\b
Run it:        batchgate up                   (embedded Redis, API, supervisor, worker; Ctrl-C stops all)
Give it work:  batchgate flows apply -f flow.yaml
               batchgate jobs plan --flow resume-screening          (what it will take; runs nothing)
               batchgate jobs create --flow resume-screening --watch
Watch it:      batchgate jobs list | show | log | audit | batches | cost | quarantine
Steer it:      batchgate jobs pause | resume | cancel | retry-failed | retry-quarantined | migrate | release
Decide:        batchgate approvals list | show | approve | reject

The HTTP commands (flows, jobs) find the gateway by --url, BATCHGATE_URL, else the `batchgate up`
running here (its data dir records its address and token). Server commands (up, serve, supervisor,
worker) read BATCHGATE_* settings: see the README.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path

import click
from pydantic import ValidationError
from pydantic_settings import SettingsError

from gateway import logs, metrics, tracing
from gateway.ledger.embedded import DataDirInUse, NoLedgerRedis, connect
from gateway.runtime import cli_client
from gateway.settings import Settings

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100, "terminal_width": 100}


def _version() -> str:
    try:
        return metadata.version("batchgate")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


@click.group(context_settings=CONTEXT, help=__doc__, no_args_is_help=True)
@click.version_option(_version(), "--version", "-V", prog_name="batchgate",
                      message="%(prog)s %(version)s")
def root() -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: the exit code (0 ok, 1 refused or failed, 2 bad usage)."""
    os.umask(0o077)  # data folder, AOF, logs, tokens and keys: readable by this user only
    try:
        result = root.main(args=argv, prog_name="batchgate", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        print("batchgate: aborted", file=sys.stderr)
        return 130
    except (NoLedgerRedis, DataDirInUse) as exc:
        print(f"batchgate: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `batchgate jobs show X | head`: the reader left; not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so the exit flush does not raise again
        except OSError:
            pass
        return 0
    return result if isinstance(result, int) else 0


class BadSettings(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"batchgate: {self.format_message()}", err=True)


def server_settings() -> Settings:
    """Settings for a server command, logging configured; a bad setting stops it (exit 2, naming it)."""
    try:
        settings = Settings()
    except (ValidationError, SettingsError) as exc:  # e.g. flat BATCHGATE_SECRETS, a loose config file
        raise BadSettings(f"invalid settings: {exc}") from None
    logs.configure(settings.log_level, settings.log_format,
                   [*logs.secret_values(settings), *settings.token_map()])
    return settings


def _run(fn, **kwargs) -> int:
    server_settings()
    return fn(argparse.Namespace(**kwargs)) or 0


@root.command(context_settings=CONTEXT)
@click.option("--port", type=int, default=None, help="API port (default BATCHGATE_PORT, 8080)")
def up(port: int | None) -> int:
    """All in one: Redis (embedded unless BATCHGATE_REDIS_URL), the API, a supervisor and a worker.

    Ctrl-C (or SIGTERM) stops them all; if one dies, the rest stop and `up` exits 1. The address and
    the development token's path are recorded in the data dir (up.json), so the CLI finds them from
    any folder.
    """
    return _run(cmd_up, port=port)


@root.command(context_settings=CONTEXT)
@click.option("--port", type=int, default=None, help="port (default BATCHGATE_PORT, 8080)")
@click.option("--workers", type=int, default=2, show_default=True, help="gunicorn worker processes")
def serve(port: int | None, workers: int) -> int:
    """The API under gunicorn (production), on BATCHGATE_REDIS_URL or the Redis of a running `up`."""
    return _run(cmd_serve, port=port, workers=workers)


@root.command(context_settings=CONTEXT)
@click.option("--metrics-port", type=int, default=None,
              help="serve this process's Prometheus metrics on this port (default BATCHGATE_METRICS_PORT; "
                   "0: not served)")
def supervisor(metrics_port: int | None) -> int:
    """Expire leases, recover crashed jobs, apply retention and timeouts, deliver webhooks."""
    return _run(cmd_supervisor, metrics_port=metrics_port)


@root.command(context_settings=CONTEXT)
@click.option("--concurrency", type=int, default=None,
              help="stage calls run at once in this process (threads; default "
                   "BATCHGATE_WORKER_CONCURRENCY, 16)")
@click.option("--burst", is_flag=True, help="exit once no job has work to start and nothing is in flight")
@click.option("--metrics-port", type=int, default=None,
              help="serve this process's Prometheus metrics on this port (default BATCHGATE_METRICS_PORT; "
                   "0: not served)")
def worker(concurrency: int | None, burst: bool, metrics_port: int | None) -> int:
    """A push worker: calls the platforms of push-mode stages (RQ runs the polls)."""
    return _run(cmd_worker, concurrency=concurrency, burst=burst, metrics_port=metrics_port)


@root.command(context_settings=CONTEXT)
@click.option("--tenant", default=None, help="only this tenant (default: every tenant)")
def reindex(tenant: str | None) -> int:
    """Rebuild the job index (listing by status, flow, time) from the job records; safe while jobs run."""
    return _run(cmd_reindex, tenant=tenant)


@root.command(context_settings=CONTEXT)
@click.argument("role", type=click.Choice(["api", "supervisor", "worker"]))
@click.option("--ready", is_flag=True, help="api: ask /readyz instead of /livez")
@click.option("--any-host", is_flag=True, help="supervisor, worker: a process on any host counts")
def health(role: str, ready: bool, any_host: bool) -> int:
    """Exit 0 if this host's ROLE process is alive, 1 if not (a container healthcheck).

    api: GET /livez (or /readyz) on 127.0.0.1:BATCHGATE_PORT. supervisor, worker: a beat in Redis from
    a process on this host younger than BATCHGATE_READY_INTERVALS supervisor intervals.
    """
    return _run(cmd_health, role=role, ready=ready, any_host=any_host)


@root.group(context_settings=CONTEXT)
def config() -> None:
    """Settings files for a deployment (compose.yaml uses them)."""


@config.command("init", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--tenant", default="default", show_default=True, help="the token's tenant")
@click.option("--print-token", is_flag=True, help="print the tenant's token on stdout")
def config_init(path: Path, tenant: str, print_token: bool) -> int:
    """Create PATH (mode 0600) with a signing key and a token for TENANT, unless it exists.

    Every process started with BATCHGATE_CONFIG_FILE=PATH shares them; an existing file is left exactly
    as it is, so running this again only prints (with --print-token) the tenant's token.
    """
    return cmd_config_init(argparse.Namespace(path=path, tenant=tenant, print_token=print_token))


@root.command(context_settings=CONTEXT)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> int:
    """Print the shell completion script: eval "$(batchgate completion bash)" in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    click.echo(cls(root, {}, "batchgate", "_BATCHGATE_COMPLETE").source())
    return 0


cli_client.register(root)


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
    record: Path | None = None
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
        # every child counts into one folder; the API's /metrics adds them up (gateway/metrics.py)
        env.setdefault(metrics.MULTIPROC_ENV,
                       metrics.prepare_multiprocess_dir(Path(settings.data_dir).resolve() / "metrics"))
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
        record = _record_up(settings, base, tokens)
        print(f"batchgate: API on {base} (Ctrl-C stops everything)", flush=True)
        return 0 if _watch(children, stop) else 1
    finally:
        if record is not None:
            record.unlink(missing_ok=True)
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


def _record_up(settings: Settings, base: str, tokens: dict[str, str]) -> Path | None:
    """Tell the CLI where this `up` listens and where its development token is (gateway/client.py
    discover): ``<data dir>/up.json``, and a pointer to the data dir in the user's state folder, so
    `batchgate jobs ...` finds it from any folder. Never the token itself."""
    import json

    from gateway.client import UP_RECORD, state_dir
    from gateway.runtime import procs

    data_dir = Path(settings.data_dir).resolve()
    token_file = data_dir / procs.TOKEN_FILE
    body = {"url": base, "pid": os.getpid(), "data_dir": str(data_dir),
            "token_file": str(token_file) if not settings.tokens and token_file.exists() else None}
    try:
        path = data_dir / UP_RECORD
        path.write_text(json.dumps(body))
        pointer = state_dir(os.environ)
        pointer.mkdir(parents=True, exist_ok=True)
        (pointer / "last-up.json").write_text(json.dumps({"data_dir": str(data_dir), "url": base}))
        return path
    except OSError as exc:  # a read-only home: the CLI still finds it from the data dir's folder
        print(f"batchgate: could not record this up's address ({exc.strerror})", file=sys.stderr)
        return None


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
    if not os.environ.get(metrics.MULTIPROC_ENV):  # gunicorn's workers count into one folder (/metrics)
        os.environ[metrics.MULTIPROC_ENV] = metrics.prepare_multiprocess_dir(
            Path(settings.data_dir).resolve() / f"metrics-serve-{port}")
    command = [*procs.python("-m", "gunicorn"), "--config", procs.GUNICORN_CONF,
               # the access log on stdout, signed tokens cut from paths (gateway/runtime/gunicorn_log.py)
               "--access-logfile", "-", "--logger-class", "gateway.runtime.gunicorn_log.Logger",
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
    metrics.serve_port(getattr(args, "metrics_port", None) or settings.metrics_port)
    tracing.setup("batchgate-worker")
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
    tracing.setup("batchgate-supervisor")
    metrics.serve_port(getattr(args, "metrics_port", None) or settings.metrics_port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.stop.set())
    supervisor.run()
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """One line on stdout; exit 0 when the role's process here is alive, 1 when not."""
    settings = Settings()
    if args.role == "api":
        import requests

        path = "/readyz" if args.ready else "/livez"
        url = f"http://127.0.0.1:{settings.port}{path}"
        try:
            resp = requests.get(url, timeout=3)
        except requests.RequestException as exc:
            print(f"api: {url} does not answer ({type(exc).__name__})")
            return 1
        print(f"api: {url} answered {resp.status_code}")
        return 0 if resp.status_code == 200 else 1
    import socket

    from redis.exceptions import RedisError

    from gateway.ledger.keys import Keys
    from gateway.ledger.liveness import Liveness

    max_age = settings.ready_intervals * settings.supervisor_interval.total_seconds()
    try:
        client, settings = connect(settings)
        beats = Liveness(client, Keys(settings.key_prefix), args.role).beats(
            None if args.any_host else socket.gethostname())
    except RedisError as exc:
        print(f"{args.role}: Redis does not answer ({type(exc).__name__})")
        return 1
    fresh = [b for b in beats if b.age_s <= max_age]
    where = "" if args.any_host else f" on {socket.gethostname()}"
    if fresh:
        print(f"{args.role}: {len(fresh)} alive{where}, last beat {fresh[0].age_s:.1f} s ago")
        return 0
    last = f"; last beat {beats[0].age_s:.1f} s ago" if beats else ""
    print(f"{args.role}: none alive{where} (no beat within {max_age:g} s{last})")
    return 1


def cmd_config_init(args: argparse.Namespace) -> int:
    """Create a deployment's settings file once; print where (and the token, if asked)."""
    import json
    import secrets

    from gateway.settings import read_config_file

    path: Path = args.path
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"signing_key": secrets.token_urlsafe(32),
                "tokens": {"bg_" + secrets.token_urlsafe(24): args.tenant}}
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it meanwhile: theirs stands
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                json.dump(body, fh)
            print(f"batchgate: created {path} (signing key, a token for tenant {args.tenant!r})",
                  file=sys.stderr)
    try:
        tokens = read_config_file(path).get("tokens") or {}
    except ValueError as exc:
        print(f"batchgate: {exc}", file=sys.stderr)
        return 2
    if args.print_token:
        mine = [token for token, tenant in tokens.items() if tenant == args.tenant]
        if not mine:
            print(f"batchgate: {path} has no token for tenant {args.tenant!r}", file=sys.stderr)
            return 1
        print(mine[0])
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
