"""Edge validation helpers: pydantic errors turned into problem details without echoing input."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)


def problem_errors(exc: ValidationError) -> list[dict[str, str]]:
    """Field paths and messages only: input values may hold secrets."""
    return [{"field": ".".join(str(p) for p in err["loc"]) or "(body)", "message": err["msg"]}
            for err in exc.errors(include_url=False, include_input=False)]


def parse(model: type[M], payload: Any, what: str) -> M:
    """Validate ``payload`` as ``model`` or raise InvalidRequest naming each bad field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequest(f"{what} is invalid", errors=problem_errors(exc)) from exc
