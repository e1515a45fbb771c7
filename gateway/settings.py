"""Settings: one pydantic-settings object, built in entry points and passed down."""

from __future__ import annotations

import json
import os
import re
import stat
from datetime import timedelta
from pathlib import Path
from secrets import token_urlsafe
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The secrets tenant whose entries every tenant may name (a tenant's own entry of the same name wins).
SHARED = "*"
#: What a tenant name may be: a letter or digit, then letters, digits, ``_``, ``.`` or ``-``; at most 64
#: characters (the flow id charset). Never ``:`` (the key separator) nor ``{}`` (hash tags), so no two
#: tenants' Redis keys can collide (ledger.keys).
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: Settings that hold credentials: never passed to a child process in its environment (see procs.child_env).
#: The development token's file under data_dir (mode 0600), used when BATCHGATE_TOKENS is unset.
DEV_TOKEN_FILE = "dev-token"
CREDENTIAL_FIELDS = ("tokens", "secrets", "signing_key", "redis_url", "queue_redis_url", "metrics_token")
FLAT_SECRETS = (
    "BATCHGATE_SECRETS maps tenant -> {{secret name: value}}, but these entries hold a value directly: "
    "{names} (the old flat form, where every tenant could name every secret). Give each secret to the tenant "
    'whose flows use it, {{"<tenant>": {{"{first}": "..."}}}}, or share it with every tenant explicitly '
    'under "*": {{"*": {{"{first}": "..."}}}}.')


class TenantQuota(BaseModel):
    """One tenant's quotas (``quota_overrides``); a field left out keeps the default, 0 = no limit."""

    model_config = ConfigDict(extra="forbid")

    active_jobs: int | None = Field(default=None, ge=0)
    job_creations_per_minute: int | None = Field(default=None, ge=0)
    leases_per_second: int | None = Field(default=None, ge=0)


class Settings(BaseSettings):
    """Everything batchgate reads from its environment (prefix ``BATCHGATE_``)."""

    _dev_tokens: dict[str, str] | None = PrivateAttr(default=None)

    # hide_input_in_errors: a validation error must not echo a token, secret or key it was given
    model_config = SettingsConfigDict(env_prefix="BATCHGATE_", extra="ignore", hide_input_in_errors=True)

    config_file: Path | None = Field(
        default=None, description="JSON file (mode 0600) of settings by field name, read under the "
        "environment: how credentials reach a process without its environment holding them")

    redis_url: SecretStr | None = Field(
        default=None, description="Ledger Redis; unset = the embedded redis-server of `batchgate up` "
        "(recorded in data_dir/redis.json); other commands join it or refuse to start"
    )
    data_dir: Path = Field(default=Path(".batchgate"), description="Embedded Redis data folder")
    key_prefix: str = Field(default="bg", pattern=r"^[A-Za-z0-9_.-]+$")
    tokens: dict[str, str] = Field(
        default_factory=dict, repr=False, description='Bearer token -> tenant, as JSON: {"tok": "acme"}'
    )
    recovery: Literal["record", "auto"] = "auto"
    idempotency_ttl: timedelta = timedelta(hours=24)
    max_body_bytes: int = 10 * 1024 * 1024
    log_maxlen: int = 10_000
    spec_cache: int = Field(
        default=1024, ge=1, le=1_000_000, description="job specs each process keeps in memory "
        "(least recently used dropped; a spec is its params plus its parsed flow)")
    supervisor_interval: timedelta = timedelta(seconds=1)
    metrics_token: SecretStr | None = Field(
        default=None, repr=False, description="if set, GET /metrics needs Authorization: Bearer <it>")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="supervisor and worker: serve their metrics on this port "
        "(0: not served; under up they reach the API's /metrics through PROMETHEUS_MULTIPROC_DIR)")
    ready_intervals: int = Field(
        default=10, ge=1, le=10_000, description="/readyz and `batchgate health` count a supervisor or "
        "worker alive while its last beat is younger than this many supervisor intervals")
    queue_redis_url: SecretStr | None = Field(
        default=None, description="RQ's Redis (push mode); unset = the ledger's Redis; required in "
        "cluster mode (RQ needs a plain Redis: docs/design.md, Cluster)")
    redis_cluster: bool = Field(
        default=False, description="the ledger's Redis is a Redis Cluster (also implied by a "
        "redis+cluster:// or rediss+cluster:// BATCHGATE_REDIS_URL)")
    redis_connect_timeout: timedelta = Field(
        default=timedelta(seconds=5), description="every Redis client: give up connecting after this long")
    redis_read_timeout: timedelta = Field(
        default=timedelta(seconds=30), description="every ledger Redis client: a reply not read within "
        "this long is a timeout error, not a hang on a half-open connection (longer than any blocking "
        "command batchgate sends; RQ's queue client gets its own, longer than RQ's BLPOP)")
    redis_health_check_interval: int = Field(
        default=30, ge=0, description="seconds a pooled Redis connection may idle before a PING checks it")
    redis_wait_replicas: int = Field(
        default=0, ge=0, le=16, description="after each commit script, WAIT for this many replicas to "
        "acknowledge it (0: no WAIT); fewer within redis_wait_timeout logs a warning and counts "
        "batchgate_redis_wait_short_total (the commit stands: it took effect on the master)")
    redis_wait_timeout: timedelta = Field(
        default=timedelta(milliseconds=500), description="how long one WAIT may take")
    signing_key: SecretStr | None = Field(
        default=None, description="HMAC key for outbound signatures, callback and blob URLs; "
        "unset = a key generated once under data_dir")
    secrets: dict[str, dict[str, SecretStr]] = Field(
        default_factory=dict, description='platform credentials by tenant and name: '
        '{"acme": {"dify_app": "app-..."}, "*": {"shared_n8n": "..."}} ("*": every tenant)')
    public_url: str | None = Field(
        default=None, description="base URL platforms use to reach batchgate (callbacks, blobs)")
    outbound_allow: list[str] = Field(
        default_factory=list, description="hosts or CIDRs batchgate may call although not public")
    inline_max_bytes: int = Field(default=256 * 1024, description="bigger items go by reference")
    source_roots: dict[str, list[str]] = Field(
        default_factory=dict, description='directories jsonl/csv "path" sources may read, by tenant, '
        '"*" for every tenant: {"*": ["/srv/shared"], "acme": ["/srv/acme"]} (a JSON list = shared); '
        "unset or empty = file paths are off")
    sink_roots: dict[str, list[str]] = Field(
        default_factory=dict, description='directories jsonl/csv result sinks may write, by tenant, '
        '"*" for every tenant (as source_roots); unset or empty = file sinks are off')
    sink_s3_buckets: dict[str, list[str]] = Field(
        default_factory=dict, description='buckets ("results") or bucket prefixes ("results/acme/") s3 '
        'result sinks may write, by tenant, "*" for every tenant (a JSON list = shared); '
        'unset = s3 sinks are off')
    s3_endpoint_url: str | None = Field(
        default=None, description="an S3-compatible endpoint (MinIO, R2, ...) for s3 sinks; unset = AWS. "
        "Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID, a profile, an instance role)")
    s3_region: str | None = Field(default=None, description="the s3 sinks' region (else boto3's default)")
    due_shards: int = Field(default=1, ge=1, le=1024, description="sorted sets the supervisor's due index "
                            "is cut into (a job's by crc32 of its id): on a Redis Cluster, about 4 per "
                            "master spreads its writes (one per lease) over the masters; 1 on one Redis")
    log_at_rest: int = Field(default=100, ge=0, description="entries a job's log keeps once the job is at "
                             "rest and its results are delivered to its sink (jobs with a sink only)")
    sink_chunk: int = Field(default=200, ge=1, le=5000,
                            description="most batches one sink delivery writes or posts")
    sink_grace: timedelta = Field(default=timedelta(seconds=60), ge=timedelta(0),
                                  description="a committed batch goes to the sink (and compacts) this long "
                                  "after its commit, so a repeated answer still gets its first answer")
    sink_timeout: timedelta = Field(default=timedelta(seconds=30), gt=timedelta(0),
                                    description="an HTTP sink's connect and read timeout")
    max_record_bytes: int = Field(
        default=1024 * 1024, ge=1, description="cap on a jsonl line / csv record (a source's "
        "max_record_bytes may ask for less, or more up to this)")
    max_batch_bytes: int = Field(
        default=128 * 1024 * 1024, ge=1024, description="most bytes one batch read from a file source may "
        "hold (max_items x max_record_bytes, or the flow's max_bytes); a flow whose bound is higher must "
        "set batching.max_bytes (422). Also what one plan reads ahead at most")
    source_read_timeout: timedelta = Field(
        default=timedelta(seconds=30), description="a URL source read fails (retryable) after this long "
        "without a byte")
    callback_grace: timedelta = timedelta(hours=1)
    outage_pause_after: timedelta = Field(
        default=timedelta(minutes=10), description="a push target unavailable this long (refusing "
        "connections, 429/503, webhooks not registered) pauses the jobs waiting on it, with the reason; "
        "until then their batches wait without spending attempts")
    outage_cooldown_max: timedelta = Field(
        default=timedelta(seconds=30), description="longest wait between probes of an unavailable "
        "target (the wait doubles from 1 s)")
    worker_concurrency: int = Field(
        default=16, ge=1, le=1024, description="stage calls one `batchgate worker` process runs at once "
        "(threads; `batchgate up` starts 64)")
    worker_grace: timedelta = Field(
        default=timedelta(seconds=30), description="after SIGTERM, how long a worker lets its in-flight "
        "calls finish before it exits")
    embedded_fsync: Literal["always", "everysec"] = Field(
        default="everysec", description="appendfsync of the embedded Redis")
    # -- per-tenant quotas (0 = no limit), counted in Redis across every process; docs/design.md --
    quota_active_jobs: int = Field(
        default=10_000, ge=0, description="jobs one tenant may have that are not finished (running, "
        "paused, held, waiting or failed; succeeded and cancelled jobs do not count): a creation past "
        "it is a 429")
    quota_job_creations_per_minute: int = Field(
        default=12_000, ge=0, description="job creations one tenant may make per minute (a burst of "
        "this many, then one every 60/N s): past it a 429 with Retry-After")
    quota_leases_per_second: int = Field(
        default=1_000, ge=0, description="pull-mode leases (POST /v1/jobs/<id>/lease) one tenant may "
        "ask for per second, answered or not; push workers' own leases are not counted")
    quota_overrides: dict[str, TenantQuota] = Field(
        default_factory=dict, description='per tenant, as JSON: {"acme": {"active_jobs": 50, '
        '"job_creations_per_minute": 60, "leases_per_second": 20}}; fields left out keep the defaults')

    def quota_for(self, tenant: str) -> TenantQuota:
        """``tenant``'s quotas: its ``quota_overrides`` entry, the ``quota_*`` defaults for the rest."""
        own = self.quota_overrides.get(tenant) or TenantQuota()
        return TenantQuota(
            active_jobs=self.quota_active_jobs if own.active_jobs is None else own.active_jobs,
            job_creations_per_minute=(self.quota_job_creations_per_minute
                                      if own.job_creations_per_minute is None
                                      else own.job_creations_per_minute),
            leases_per_second=(self.quota_leases_per_second if own.leases_per_second is None
                               else own.leases_per_second))

    log_level: str = "INFO"
    log_format: Literal["text", "json"] = Field(
        default="text", description="text for a terminal; json: one object per line with job fields")
    host: str = "127.0.0.1"
    port: int = 8080

    @field_validator("source_roots", "sink_roots", mode="before")
    @classmethod
    def _roots(cls, value: object) -> object:
        """A plain list of roots is shared by every tenant; roots must be absolute paths."""
        if isinstance(value, (list, tuple)):
            value = {"*": list(value)}
        if isinstance(value, dict):
            for tenant, roots in value.items():
                for root in roots if isinstance(roots, (list, tuple)) else [roots]:
                    if not isinstance(root, (str, Path)) or not os.path.isabs(root):
                        raise ValueError(f"source_roots[{tenant!r}]: {root!r} is not an absolute path")
            value = {t: [str(r) for r in (rs if isinstance(rs, (list, tuple)) else [rs])]
                     for t, rs in value.items()}
            for tenant in value:
                if tenant != SHARED:
                    check_tenant_name(tenant, "BATCHGATE_SOURCE_ROOTS")
        return value

    @field_validator("sink_s3_buckets", mode="before")
    @classmethod
    def _buckets(cls, value: object) -> object:
        """A plain list of buckets is shared by every tenant."""
        if isinstance(value, (list, tuple)):
            value = {"*": list(value)}
        if isinstance(value, dict):
            for tenant in value:
                if tenant != SHARED:
                    check_tenant_name(tenant, "BATCHGATE_SINK_S3_BUCKETS")
        return value

    @field_validator("idempotency_ttl", "supervisor_interval", "callback_grace", "source_read_timeout",
                     "outage_pause_after", "outage_cooldown_max", "worker_grace", "redis_connect_timeout",
                     "sink_timeout", "sink_grace",
                     "redis_read_timeout", "redis_wait_timeout", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> object:
        """Durations from the environment may be plain seconds ("0.2") or ISO 8601 ("PT24H")."""
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
        return value

    @model_validator(mode="before")
    @classmethod
    def _read_config_file(cls, data: Any) -> Any:
        """Fill what neither the arguments nor the environment set from ``config_file``."""
        if not isinstance(data, dict) or not data.get("config_file"):
            return data
        return {**read_config_file(Path(data["config_file"])), **data}

    @field_validator("tokens")
    @classmethod
    def _tenant_names(cls, value: dict[str, str]) -> dict[str, str]:
        """Every token's tenant is a valid name (the message names the tenant, never the token)."""
        for tenant in value.values():
            if tenant == SHARED:
                raise ValueError(f"a token's tenant must be a name other than {SHARED!r} "
                                 "(reserved for secrets shared by all tenants)")
            check_tenant_name(tenant, "BATCHGATE_TOKENS")
        return value

    @field_validator("secrets", mode="before")
    @classmethod
    def _secrets_by_tenant(cls, value: Any) -> Any:
        """Refuse the old flat ``{name: value}`` form with a migration hint (names only, never values)."""
        if not isinstance(value, dict):
            return value
        flat = sorted(str(k) for k, v in value.items() if not isinstance(v, dict))
        if flat:
            names = ", ".join(repr(n) for n in flat[:5]) + (" ..." if len(flat) > 5 else "")
            raise ValueError(FLAT_SECRETS.format(names=names, first=flat[0]))
        for tenant in value:
            if tenant != SHARED:
                check_tenant_name(tenant, "BATCHGATE_SECRETS")
        return value

    def secret_for(self, tenant: str, name: str) -> str | None:
        """The value of secret ``name`` for ``tenant``: its own entry, else the shared ``*`` one."""
        for owner in (tenant, SHARED):
            value = self.secrets.get(owner, {}).get(name)
            if value is not None:
                return value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        return None

    def secret_names(self, tenant: str) -> set[str]:
        """Names of the secrets ``tenant`` may use: its own and the shared ones."""
        return set(self.secrets.get(tenant, {})) | set(self.secrets.get(SHARED, {}))

    def credential_values(self) -> dict[str, Any]:
        """The credential settings as plain JSON values (for a child's config file), unset ones left out."""
        out: dict[str, Any] = {"tokens": dict(self.tokens),
                               "secrets": {tenant: {name: _plain(v) for name, v in entries.items()}
                                           for tenant, entries in self.secrets.items()}}
        for name in ("signing_key", "redis_url", "queue_redis_url"):
            value = getattr(self, name)
            if value is not None:
                out[name] = _plain(value)
        return out

    def config_file_values(self) -> dict[str, Any]:
        """What ``config_file`` holds ({} without one)."""
        return read_config_file(Path(self.config_file)) if self.config_file else {}

    def token_map(self) -> dict[str, str]:
        """Bearer tokens mapped to tenant names: ``tokens``, else the development token that ``up`` or
        ``serve`` keeps in ``data_dir`` (tenant ``default``), so every process on one data folder takes
        the same token; empty when neither exists."""
        if self.tokens:
            return dict(self.tokens)
        if self._dev_tokens is None:
            token = self.dev_token()
            if token is None:
                return {}  # not created yet: looked for again on the next request
            self._dev_tokens = {token: "default"} if token else {}
        return dict(self._dev_tokens)

    def dev_token(self) -> str | None:
        """The development token kept in ``data_dir`` by ``up`` or ``serve``, None before it exists."""
        try:
            return (Path(self.data_dir) / DEV_TOKEN_FILE).read_text().strip()
        except OSError:
            return None

    def base_url(self) -> str:
        """Where platforms reach this gateway."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    def signing_secret(self) -> bytes:
        """The HMAC key: from settings, else generated once (mode 0600) under ``data_dir``."""
        if self.signing_key is not None:
            return self.signing_key.get_secret_value().encode()
        path = Path(self.data_dir) / "signing-key"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(token_urlsafe(32))
            except FileExistsError:
                pass
        return path.read_text().strip().encode()


def check_tenant_name(tenant: Any, setting: str) -> None:
    """ValueError naming ``setting`` and the tenant (shortened) unless it matches :data:`TENANT_NAME`."""
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        shown = repr(tenant)
        shown = shown if len(shown) <= 80 else shown[:79] + "\u2026"
        raise ValueError(f"{setting}: tenant name {shown} is not valid: a tenant name is 1-64 characters, "
                         "letters, digits, '_', '.' or '-', starting with a letter or digit (no ':', "
                         "which separates the parts of Redis keys)")


def _plain(value: Any) -> str:
    return value.get_secret_value() if isinstance(value, SecretStr) else str(value)


def read_config_file(path: Path) -> dict[str, Any]:
    """A settings file: a JSON object of field names (``tokens``, ``secrets``, ``signing_key``, ...).

    Refused (ValueError, naming the path, never the content) unless it is a regular file that only its
    owner may read and write (``chmod 600``), holds a JSON object, and names known settings only.
    """
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"config file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise ValueError(f"config file {path} is readable or writable by others "
                             f"(mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it")
        data = json.loads(path.read_text())
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"config file {path} cannot be read: {reason}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"config file {path} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a JSON object of settings")
    unknown = sorted(set(data) - set(Settings.model_fields) | ({"config_file"} & set(data)))
    if unknown:
        raise ValueError(f"config file {path} names unknown settings: {', '.join(map(str, unknown))} "
                         f"(use field names such as tokens, secrets, signing_key)")
    return data


def write_config_file(directory: Path, values: dict[str, Any], name: str) -> Path:
    """Write ``values`` to ``directory/name`` atomically: mode 0600, the directory created 0700 if missing."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.{token_urlsafe(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(values, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
