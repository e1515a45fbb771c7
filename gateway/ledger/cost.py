"""The cost ledger read back: what a job's platform calls cost, in total and per stage.

complete.lua and fail.lua count each call in the job's cost hash (keys.py ``JobKeys.cost``, lib.lua
``record_cost``) in the step that takes its answer. This module turns that hash into the job view's
``cost`` section; dryrun.py reads the same hashes of a flow's recent jobs for its estimates.
"""

from __future__ import annotations

from typing import Any

from gateway.ledger.jobspec import JobSpec

REASONS = ("first", "retry", "rerun", "bisection")
"""Why a call ran (lib.lua call_reason): its stage's first attempt; a retry after a failed attempt; a re-run
after the attempt before lost its worker or callback (its lease expired: "redone"); a bisection child."""


def _num(fields: dict[str, str], name: str) -> float:
    try:
        return float(fields.get(name) or 0)
    except ValueError:
        return 0.0


def _figures(fields: dict[str, str], suffix: str = "") -> dict[str, Any]:
    """One stage's figures (``suffix`` ':<index>'; '' reads the job-wide fields, kept only for budgets)."""
    def n(name: str) -> int:
        return int(_num(fields, name + suffix))

    def price(name: str) -> float | None:
        return round(_num(fields, name + suffix), 10) if fields.get(name + suffix) else None

    return {
        "calls": n("calls"),
        "paid_calls": n("paid"),
        "tokens": n("tokens"),
        "price": price("price"),
        "call_seconds": round(n("ms") / 1000, 3),
        # 'first' is not stored (one write less per commit): the calls that ran for no other reason
        "by_reason": {r: k for r in REASONS if (k := n(f"r_{r}") if r != "first" else
                                                 n("calls") - sum(n(f"r_{o}") for o in REASONS[1:]))},
        # calls re-run after a lost worker or callback, and what they cost: what the crashes cost
        "redone": {"calls": n("redone"), "tokens": n("redone_tokens"), "price": price("redone_price")},
    }


def _sum(scopes: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures: its stages' added up (the cost hash keeps them per stage only)."""
    def add(values: list[Any]) -> Any:
        if all(isinstance(v, dict) for v in values) and values:
            return {k: add([v[k] for v in values if k in v]) for k in {k for v in values for k in v}}
        present = [v for v in values if v is not None]
        if not present:
            return None
        total = sum(present)
        return round(total, 10) if isinstance(total, float) else total

    if not scopes:
        return _figures({})
    view = {name: add([s[name] for s in scopes]) for name in scopes[0]}
    view["call_seconds"] = round(view["call_seconds"], 3)
    return view


def cost_view(spec: JobSpec, fields: dict[str, str]) -> dict[str, Any]:
    """The job view's ``cost`` section from the job's cost hash as read."""
    stages = {stage.name: _figures(fields, f":{i}") for i, stage in enumerate(spec.flow.stages)
              if fields.get(f"calls:{i}")}
    view = _sum(list(stages.values()))
    view["currency"] = fields.get("currency") or None
    view["stages"] = stages
    budget = spec.flow.budget
    view["budget"] = None if budget is None else {
        "tokens": budget.tokens, "price": budget.price,
        "paused": fields.get("budget_paused") or None}
    return view
