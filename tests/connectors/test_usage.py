"""What each connector reads of a platform's cost report (connectors/base.py Usage; the cost ledger)."""

from __future__ import annotations

import pytest

from connectors import coze, coze_stream, dify
from connectors.base import Answer, Done, PlatformError, Usage
from tests.connectors.helpers import call

DIFY = call({"type": "dify", "base_url": "https://dify.example", "api_key_secret": "DIFY"})


def run(status: str, **fields) -> dict:
    return {"id": "run-1", "status": status, "outputs": {"text": "ok"}, "error": "boom", **fields}


def test_dify_run_records_give_tokens_price_and_currency():
    # the same record shape answers a blocking run (data), workflow_finished (data) and a poll
    out = dify._run_outcome(run("succeeded", total_tokens=1234, total_price="0.0246800", currency="USD"),
                            {}, DIFY)
    assert isinstance(out, Done) and out.answer.usage == Usage(1234, "0.02468", "USD")
    # a record without a price (most Dify versions' workflow runs): tokens only
    assert dify._run_outcome(run("succeeded", total_tokens=7), {}, DIFY).answer.usage == Usage(7, None, None)
    # price and currency where only execution_metadata carries them, as node records do
    meta = {"total_tokens": 5, "total_price": "0.001", "currency": "RMB"}
    assert dify._run_outcome(run("succeeded", execution_metadata=meta), {}, DIFY).answer.usage == Usage(
        5, "0.001", "RMB")
    # nothing reported (0 tokens is a report: the call is counted, not paid)
    assert dify._run_outcome(run("succeeded"), {}, DIFY).answer.usage is None
    # a failed run still billed what its LLM nodes used: on the error, for the ledger's fail
    with pytest.raises(PlatformError) as info:
        dify._run_outcome(run("failed", total_tokens=99), {}, DIFY)
    assert info.value.usage == Usage(99, None, None)


def test_coze_usage_from_sync_answers_history_records_and_stream_messages():
    assert coze_stream.usage_of({"token_count": 300, "input_count": 200, "output_count": 100}) == Usage(300)
    assert coze_stream.usage_of({"input_count": 20, "output_count": 10}) == Usage(30)
    assert coze_stream.usage_of(None) is None and coze_stream.usage_of({"token_count": "x"}) is None
    answer = coze.with_usage(Answer(True, output=1), {"token_count": 42})
    assert answer.usage == Usage(42) and answer.output == 1
    body = {"code": 0, "data": '{"output": "done"}', "usage": {"token_count": 11}}
    out = coze._sync_outcome(body, call({"type": "coze"}), {})
    assert isinstance(out, Done) and out.answer.usage == Usage(11)


@pytest.mark.parametrize(("raw", "usage"), [
    ({"tokens": 10, "price": 0.5, "currency": "eur"}, Usage(10, "0.5", "EUR")),
    ({"tokens": 10}, Usage(10)),
    ({"price": "1e-4"}, Usage(None, "0.0001", None)),
    ({"tokens": -1, "price": "free", "currency": "US$"}, None),  # nothing that is a count or amount
    ({"tokens": True}, None),
])
def test_answer_contract_usage_is_read_strictly(raw, usage):
    assert Answer.parse({"status": "succeeded", "output": 1, "usage": raw}).usage == usage
    assert Answer.parse({"status": "failed", "error": {"message": "x"}, "usage": raw}).usage == usage
