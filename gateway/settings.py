"""Settings: one pydantic-settings object, built in entry points and passed down."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from secrets import token_urlsafe
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything batchgate reads from its environment (prefix ``BATCHGATE_``)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGATE_", extra="ignore")

    redis_url: SecretStr | None = Field(
        default=None, description="Ledger Redis; unset = start an embedded redis-server"
    )
    data_dir: Path = Field(default=Path(".batchgate"), description="Embedded Redis data folder")
    key_prefix: str = Field(default="bg", pattern=r"^[A-Za-z0-9_.-]+$")
    tokens: dict[str, str] = Field(
        default_factory=dict, description='Bearer token -> tenant, as JSON: {"tok": "acme"}'
    )
    recovery: Literal["record", "auto"] = "auto"
    idempotency_ttl: timedelta = timedelta(hours=24)
    max_body_bytes: int = 10 * 1024 * 1024
    log_maxlen: int = 10_000
    supervisor_interval: timedelta = timedelta(seconds=1)
    queue_redis_url: SecretStr | None = Field(
        default=None, description="RQ's Redis (push mode); unset = the ledger's Redis")
    signing_key: SecretStr | None = Field(
        default=None, description="HMAC key for outbound signatures, callback and blob URLs; "
        "unset = a key generated once under data_dir")
    secrets: dict[str, SecretStr] = Field(
        default_factory=dict, description='platform credentials by name: {"dify_app": "app-..."}')
    public_url: str | None = Field(
        default=None, description="base URL platforms use to reach batchgate (callbacks, blobs)")
    outbound_allow: list[str] = Field(
        default_factory=list, description="hosts or CIDRs batchgate may call although not public")
    inline_max_bytes: int = Field(default=256 * 1024, description="bigger items go by reference")
    callback_grace: timedelta = timedelta(hours=1)
    embedded_fsync: Literal["always", "everysec"] = Field(
        default="everysec", description="appendfsync of the embedded Redis")
    log_level: str = "INFO"
    host: str = "127.0.0.1"
    port: int = 8080

    @field_validator("idempotency_ttl", "supervisor_interval", "callback_grace", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> object:
        """Durations from the environment may be plain seconds ("0.2") or ISO 8601 ("PT24H")."""
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
        return value

    def token_map(self) -> dict[str, str]:
        """Bearer tokens mapped to tenant names."""
        return dict(self.tokens)

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
