"""The planner alone, with no Redis: it reads a source from a cursor and cuts the batches plan.lua records.

gateway/ledger/planner.py is the ledger's one seam for reading sources; the import contracts keep it
free of redis. These tests give it plain Python lists for inline items and files under a tmp folder.
"""

from __future__ import annotations

import json

import pytest

import chunker
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobspec import JobSpec, initial_cursor
from gateway.ledger.planner import batches_per_plan, cut_batches
from gateway.settings import Settings


def spec(source: dict, max_items: int = 3, max_bytes: int | None = None) -> JobSpec:
    batching = {"max_items": max_items, **({"max_bytes": max_bytes} if max_bytes else {})}
    flow = parse_flow({"id": "f", "version": "1", "stages": [{"name": "s"}], "batching": batching})
    return JobSpec(job_id="job_p", tenant="acme", flow=flow, flow_hash="h", source=source, params={},
                   total_hint=None)


def items_of(batches) -> list:
    return [item for _, _, items, _ in batches for item in json.loads(items)]


def test_inline_items_are_cut_in_order_and_the_last_batch_says_the_source_ends():
    items = list(range(8))
    got = cut_batches(spec({"type": "inline"}), {"type": "offset", "offset": 0}, 16, items, Settings())
    assert [count for *_, count in got] == [3, 3, 2]
    assert items_of(got) == items
    assert [ended for _, ended, _, _ in got] == ["0", "0", "1"]
    assert json.loads(got[0][0]) == {"type": "offset", "offset": 3}  # the next batch's cursor


def test_a_plan_stops_at_ahead_and_goes_on_from_its_cursor():
    job = spec({"type": "sequence", "count": 10})
    first = cut_batches(job, initial_cursor(job.source), 2, None, Settings())
    assert items_of(first) == list(range(6))
    rest = cut_batches(job, json.loads(first[-1][0]), 16, None, Settings())
    assert items_of(first) + items_of(rest) == list(range(10))


def test_a_read_that_fails_first_raises_and_one_that_fails_later_ends_the_plan(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"n": n}) + "\n" for n in range(4)) + "{not json\n")
    settings = Settings(source_roots={"*": [str(tmp_path)]}, data_dir=tmp_path / "data")
    job = spec({"type": "jsonl", "path": str(path)}, max_items=2)
    got = cut_batches(job, initial_cursor(job.source), 16, None, settings)
    assert items_of(got) == [{"n": n} for n in range(4)]  # the bad line is met by the next plan
    with pytest.raises((chunker.SourceReadError, chunker.SourceSpecError)):
        cut_batches(job, json.loads(got[-1][0]), 16, None, settings)


def test_reading_ahead_only_where_reads_are_cheap():
    assert batches_per_plan(spec({"type": "inline"}), 16) == 16
    assert batches_per_plan(spec({"type": "sequence", "count": 5}), 16) == 16
    assert batches_per_plan(spec({"type": "jsonl", "url": "https://example.com/a.jsonl"}), 16) == 1
    assert batches_per_plan(spec({"type": "sequence", "count": 5}), 0) == 1
