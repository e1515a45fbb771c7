"""Bisection of poison items, the Python side (docs/design.md "Bisection").

The scripts decide (fail.lua splits or quarantines, complete.lua keeps each piece's output, qretry.lua
re-opens quarantined items); this module reads what they recorded: which of a batch's items a lease
runs (``selection``, the twin of lib.lua's), the items and input a piece hands out (``cut``), the key
suffix that keeps an idempotency key stable per item range (``key_suffix``), and the quarantine as the
API shows it (``entries``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# failures that never bisect: the flow may have run (or is waiting for a person), so running its items
# again in halves could do twice what it did once; outages never reach ``fail`` at all
NEVER_BISECT = frozenset({"outcome_unknown", "max_run", "waiting_human", "corrupt"})


def indices(text: str | None) -> list[int]:
    """A batch record's list of item indices (bq, only, qri: JSON lists, '' for none)."""
    return json.loads(text) if text else []


def selection(batch: dict[str, str]) -> list[int] | None:
    """The item indices a lease of ``batch`` at its current stage runs; None = the whole batch."""
    stage = int(batch.get("stage") or 0)
    if batch.get("bis"):
        bis = json.loads(batch["bis"])
        if int(bis["s"]) == stage:
            return list(bis["p"][0])
    if not batch.get("only") and not batch.get("bq"):
        return None
    if batch.get("only"):
        return indices(batch["only"])
    gone = set(indices(batch.get("bq")))
    return [i for i in range(int(batch["n_items"])) if i not in gone]


def cut(piece: list[int] | None, items: Any, input_: Any) -> tuple[Any, Any]:
    """The items (and the previous stage's output, when it is a list with one entry per item) of
    ``piece``; both unchanged for the whole batch."""
    if piece is None or not isinstance(items, list):
        return items, input_
    picked = [items[i] for i in piece if i < len(items)]
    if isinstance(input_, list) and len(input_) == len(items):
        input_ = [input_[i] for i in piece]
    return picked, input_


def key_suffix(piece: list[int] | None) -> str:
    """What a piece adds to its stage's idempotency key: ``:b<first>-<end>`` for a range of items
    (end exclusive), ``:i<digest>`` for other sets; '' for the whole batch. Stable: the same items of
    the same batch range always get the same key."""
    if piece is None:
        return ""
    if piece and piece == list(range(piece[0], piece[0] + len(piece))):
        return f":b{piece[0]}-{piece[0] + len(piece)}"
    return ":i" + hashlib.sha256(",".join(map(str, piece)).encode()).hexdigest()[:16]


def batch_fields(batch: dict[str, str]) -> dict[str, Any]:
    """What a batch view adds for bisection: the item indices quarantined, and while the batch runs in
    pieces, the pieces still to run (the first is the one leased or next) and the extra calls spent."""
    view: dict[str, Any] = {}
    if batch.get("bq"):
        view["quarantined_items"] = indices(batch["bq"])
    if batch.get("bis"):
        view["bisecting"] = {"pieces": json.loads(batch["bis"])["p"], "extra_calls": int(batch.get("bx") or 0)}
    return view


def entries(seq: int, batch: dict[str, str], items: list[Any] | None,
            stage_names: list[str]) -> list[dict[str, Any]]:
    """The quarantined items of one batch as the API shows them."""
    out = []
    for i in indices(batch.get("bq")):
        stage = int(batch.get(f"qs:{i}") or 0)
        out.append({
            "id": f"{seq}.{i}", "seq": seq, "index": i,
            "item": items[i] if items is not None and i < len(items) else None,
            "stage": stage_names[stage] if stage < len(stage_names) else str(stage),
            "error": batch.get(f"qe:{i}") or "", "error_type": batch.get(f"qt:{i}") or None,
            "quarantined_ms": int(batch.get(f"qa:{i}") or 0),
        })
    return out
