"""Settings: one pydantic-settings object, built in entry points and passed down."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
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
    embedded_fsync: Literal["always", "everysec"] = Field(
        default="everysec", description="appendfsync of the embedded Redis")
    log_level: str = "INFO"
    host: str = "127.0.0.1"
    port: int = 8080

    @field_validator("idempotency_ttl", "supervisor_interval", mode="before")
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
