"""Resuming platform runs that wait for a person, against stand-ins on a real socket
(tests/standins_waiting.py).

For each platform: the wait is reported as ``WaitingHuman`` with the platform's prompt and a JSON resume
handle; a decision resumes the run through the platform's API and the run is followed to its output;
a repeated resume (batchgate crashed between resuming and committing) reads the run's result instead of
failing; a platform that refuses, fails or hangs is classed so that nothing is resumed twice or lost.
"""

from __future__ import annotations

import json

import pytest

from connectors import get_connector
from connectors.base import Decision, Done, PlatformError, Retry, Running, WaitingHuman
from connectors.resume import follow
from tests.connectors.helpers import COZE_TOKEN, DIFY_KEY, N8N_API_KEY, call
from tests.standins import StandinN8n
from tests.standins_waiting import REVIEW_NOTE, WaitingCoze, WaitingDify, WaitingN8n

APPROVE = Decision(True, comment="looks right", actor="ana")
REJECT = Decision(False, comment="wrong total", actor="ana")


def waiting(connector, stage_call, handle, session) -> WaitingHuman:
    """Poll until the run reports it waits for a person; return that report."""
    for _ in range(50):
        try:
            outcome = connector.poll(stage_call, handle, session)
        except WaitingHuman as err:
            return err
        assert isinstance(outcome, Running), outcome
    raise AssertionError("the run never waited for a person")


def roundtrip(handle: dict) -> dict:
    """Handles are stored as JSON (an approval record): what resume gets back."""
    return json.loads(json.dumps(handle))


# -- n8n ------------------------------------------------------------------------------------------

@pytest.fixture
def n8n():
    with WaitingN8n(api_key=N8N_API_KEY, run_s=0.2) as server:
        yield server


def n8n_call(server, timeout_s=5.0):
    return call({"type": "n8n", "url": server.url, "api_url": server.base_url, "api_key_secret": "KEY"},
                {"api_key_secret": N8N_API_KEY}, timeout_s=timeout_s)


def n8n_wait(server, session, behaviour="wait_webhook", timeout_s=5.0):
    server.plan(behaviour)
    connector, stage_call = get_connector("n8n"), n8n_call(server, timeout_s)
    started = connector.trigger(stage_call, session)
    assert isinstance(started, Running)
    return connector, stage_call, waiting(connector, stage_call, started.handle, session)


def test_an_n8n_wait_node_reports_its_prompt_and_a_resume_handle(n8n, session):
    _, _, wait = n8n_wait(n8n, session)
    assert wait.retry is Retry.FATAL and wait.code == "waiting_human"  # a gateway without approvals fails it
    assert wait.prompt == REVIEW_NOTE
    execution_id = wait.platform_ids["execution_id"]
    assert wait.resume == {"platform": "n8n", "execution_id": execution_id, "node": "Review", "node_runs": 0,
                           "kind": "webhook", "resume_url": f"{n8n.base_url}/webhook-waiting/{execution_id}",
                           "method": "POST", "can_reject": True}
    assert json.loads(json.dumps(wait.resume)) == wait.resume


def test_approving_resumes_the_n8n_execution_once_and_follows_it_to_its_output(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session)
    outcome = connector.resume(stage_call, roundtrip(wait.resume), APPROVE, session)
    assert isinstance(outcome, Running)  # resumed on receipt: the execution is followed by polling
    done = follow(connector, stage_call, outcome, session, timeout_s=5, interval_s=0.05)
    assert isinstance(done, Done)
    assert done.answer.output == {"count": 3, "decision": "approve", "comment": "looks right"}
    execution_id = wait.platform_ids["execution_id"]
    assert n8n.resumed[execution_id] == 1
    sent = n8n.resume_calls[0]
    assert sent.json["approved"] is True and sent.json["decided_by"] == "ana"
    assert sent.headers["Idempotency-Key"] == stage_call.idempotency_key  # signed like every call


def test_a_second_resume_reads_the_result_instead_of_failing(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session)
    first = connector.resume(stage_call, wait.resume, APPROVE, session)
    again = connector.resume(stage_call, wait.resume, APPROVE, session)  # 409 "is running already"
    assert isinstance(first, Running) and isinstance(again, Running)
    done = follow(connector, stage_call, again, session, timeout_s=5, interval_s=0.05)
    late = connector.resume(stage_call, wait.resume, APPROVE, session)  # 409 "has finished already"
    assert isinstance(done, Done) and isinstance(late, Done) and late.answer == done.answer
    assert [r.json for r in n8n.resume_calls[1:]] and n8n.resumed[wait.platform_ids["execution_id"]] == 1


def test_a_rejection_resumes_the_wait_node_with_the_rejection(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session)
    done = follow(connector, stage_call, connector.resume(stage_call, wait.resume, REJECT, session), session,
                  timeout_s=5, interval_s=0.05)
    assert isinstance(done, Done) and done.answer.output["decision"] == "reject"


def test_a_send_and_wait_node_is_resumed_through_its_approval_link(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session, "wait_send")
    assert wait.prompt == StandinN8n.PROMPT
    assert wait.resume["kind"] == "send_and_wait" and wait.resume["method"] == "GET"
    assert wait.resume["resume_url"].endswith(f"/{WaitingN8n.SEND_NODE_ID}")
    done = follow(connector, stage_call, connector.resume(stage_call, wait.resume, REJECT, session), session,
                  timeout_s=5, interval_s=0.05)
    assert isinstance(done, Done) and done.answer.output["decision"] == "reject"
    assert n8n.resume_calls[0].query == {"approved": "false"}


def test_a_signed_send_and_wait_link_is_not_resumable_and_says_how(session):
    with WaitingN8n(api_key=N8N_API_KEY, signed=True) as server:
        _, _, wait = n8n_wait(server, session, "wait_send")
    assert wait.resume is None and "signs its approval links" in wait.how
    assert "batchgate cannot answer it" in wait.message


def test_n8n_refusing_the_resume_with_5xx_is_retryable_and_resumes_nothing(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session)
    n8n.resume_fail = 1
    with pytest.raises(PlatformError) as info:
        connector.resume(stage_call, wait.resume, APPROVE, session)
    assert info.value.retry is Retry.RETRYABLE and "still waits" in info.value.message
    assert not n8n.resumed
    outcome = connector.resume(stage_call, wait.resume, APPROVE, session)  # the retry resumes it
    assert isinstance(follow(connector, stage_call, outcome, session, timeout_s=5, interval_s=0.05), Done)
    assert n8n.resumed[wait.platform_ids["execution_id"]] == 1


def test_a_resume_at_a_path_n8n_does_not_wait_at_is_fatal(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session)
    wrong = {**wait.resume, "method": "PUT"}
    with pytest.raises(PlatformError) as info:
        connector.resume(stage_call, wrong, APPROVE, session)
    assert info.value.retry is Retry.FATAL and "matching path/method" in info.value.message
    assert not n8n.resumed


def test_a_resume_whose_answer_hangs_is_known_from_the_execution(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session, timeout_s=0.5)
    n8n.resume_hang_s = 1.0  # n8n resumes the execution, its answer comes after the call's timeout
    outcome = connector.resume(stage_call, wait.resume, APPROVE, session)
    assert isinstance(outcome, (Running, Done))  # not an error: the execution's own state says it resumed
    assert isinstance(follow(connector, stage_call, outcome, session, timeout_s=5, interval_s=0.05), Done)
    assert n8n.resumed[wait.platform_ids["execution_id"]] == 1


def test_an_unreachable_n8n_is_an_outage_not_a_lost_decision(n8n, session):
    connector, stage_call, wait = n8n_wait(n8n, session)
    handle = {**wait.resume, "resume_url": "http://127.0.0.1:9/webhook-waiting/1"}
    with pytest.raises(PlatformError) as info:
        connector.resume(stage_call, handle, APPROVE, session)
    assert info.value.retry is Retry.RETRYABLE and info.value.outage


# -- Dify -----------------------------------------------------------------------------------------

@pytest.fixture
def dify():
    with WaitingDify(api_key=DIFY_KEY, run_s=0.2) as server:
        yield server


def dify_call(server, mode="streaming", timeout_s=5.0):
    return call({"type": "dify", "base_url": server.base_url, "api_key_secret": "KEY", "mode": mode},
                {"api_key_secret": DIFY_KEY}, timeout_s=timeout_s)


def dify_wait(server, session, timeout_s=5.0):
    connector, stage_call = get_connector("dify"), dify_call(server, timeout_s=timeout_s)
    with pytest.raises(WaitingHuman) as info:
        connector.trigger(stage_call, session)
    return connector, stage_call, info.value


def test_a_dify_human_input_node_reports_its_form_as_the_resume_handle(dify, session):
    _, _, wait = dify_wait(dify, session)
    assert wait.prompt == WaitingDify.PROMPT and wait.code == "waiting_human"
    handle = wait.resume
    run_id = wait.platform_ids["workflow_run_id"]
    assert handle["platform"] == "dify" and handle["workflow_run_id"] == run_id
    assert handle["form_token"] == f"form-token-{run_id}" and handle["user"] == "batchgate"
    assert [a["id"] for a in handle["actions"]] == ["approve", "reject"]
    assert handle["node_title"] == "Approve refund"
    assert roundtrip(handle) == handle


def test_submitting_the_dify_form_resumes_the_run_and_reads_its_outputs(dify, session):
    connector, stage_call, wait = dify_wait(dify, session)
    done = connector.resume(stage_call, roundtrip(wait.resume), Decision(True, comment="total ok"), session)
    assert isinstance(done, Done)  # the resumed run's event stream, read to workflow_finished
    assert done.answer.output == {"count": 3, "action": "approve", "inputs": {"comment": "total ok"}}
    assert dify.submitted[wait.platform_ids["workflow_run_id"]] == 1
    assert dify.submit_calls[0].json["user"] == "batchgate"


def test_a_second_dify_submission_reads_the_run_instead_of_failing(dify, session):
    connector, stage_call, wait = dify_wait(dify, session)
    first = connector.resume(stage_call, wait.resume, APPROVE, session)
    again = connector.resume(stage_call, wait.resume, APPROVE, session)  # 412: submitted already
    assert isinstance(first, Done) and isinstance(again, Done) and again.answer == first.answer
    assert dify.submitted[wait.platform_ids["workflow_run_id"]] == 1


def test_a_dify_rejection_takes_the_forms_reject_action(dify, session):
    connector, stage_call, wait = dify_wait(dify, session)
    done = connector.resume(stage_call, wait.resume, REJECT, session)
    assert isinstance(done, Done) and done.answer.output["action"] == "reject"


def test_a_dify_form_without_a_reject_action_is_not_resumed_on_rejection(session):
    with WaitingDify(api_key=DIFY_KEY, actions=({"id": "ok", "title": "Looks good"},)) as server:
        connector, stage_call, wait = dify_wait(server, session)
        with pytest.raises(PlatformError) as info:
            connector.resume(stage_call, wait.resume, REJECT, session)
        assert info.value.code == "rejected" and "still waits" in info.value.message
        assert not server.submit_calls
        approved = connector.resume(stage_call, wait.resume, APPROVE, session)  # approving still works
        assert isinstance(approved, Done) and approved.answer.output["action"] == "ok"


def test_dify_failing_the_submission_is_retryable_and_changes_nothing(dify, session):
    connector, stage_call, wait = dify_wait(dify, session)
    dify.submit_fail = 1
    with pytest.raises(PlatformError) as info:
        connector.resume(stage_call, wait.resume, APPROVE, session)
    assert info.value.retry is Retry.RETRYABLE and "still paused" in info.value.message
    assert not dify.submitted
    assert isinstance(connector.resume(stage_call, wait.resume, APPROVE, session), Done)


def test_a_dify_submission_whose_answer_hangs_is_known_from_the_run(dify, session):
    connector, stage_call, wait = dify_wait(dify, session, timeout_s=0.5)
    dify.submit_hang_s = 1.0
    outcome = connector.resume(stage_call, wait.resume, APPROVE, session)
    assert isinstance(outcome, (Running, Done))
    done = follow(connector, stage_call, outcome, session, timeout_s=5, interval_s=0.05)
    assert isinstance(done, Done) and done.answer.output["action"] == "approve"
    assert dify.submitted[wait.platform_ids["workflow_run_id"]] == 1


def test_a_dify_run_seen_paused_only_by_its_status_says_how_to_answer_it(dify, session):
    connector, stage_call, wait = dify_wait(dify, session)
    with pytest.raises(WaitingHuman) as info:
        connector.poll(stage_call, {"run_id": wait.platform_ids["workflow_run_id"]}, session)
    assert info.value.resume is None and "mode streaming" in info.value.how


# -- Coze -----------------------------------------------------------------------------------------

@pytest.fixture
def coze():
    with WaitingCoze(token=COZE_TOKEN, run_s=0.1) as server:
        yield server


def coze_call(server, timeout_s=5.0):
    return call({"type": "coze", "base_url": server.base_url, "token_secret": "TOKEN", "workflow_id": "7391",
                 "mode": "stream", "studio": True}, {"token_secret": COZE_TOKEN}, timeout_s=timeout_s)


def coze_wait(server, session, timeout_s=5.0):
    server.plan("question")
    connector, stage_call = get_connector("coze"), coze_call(server, timeout_s)
    with pytest.raises(WaitingHuman) as info:
        connector.trigger(stage_call, session)
    return connector, stage_call, info.value


def test_a_coze_stream_runs_to_its_end_nodes_answer(coze, session):
    done = get_connector("coze").trigger(coze_call(coze), session)
    assert isinstance(done, Done) and done.answer.output == {"count": 3} and done.platform_ids["execute_id"]


def test_a_coze_question_reports_its_prompt_and_the_interrupt_to_resume(coze, session):
    _, _, wait = coze_wait(coze, session)
    execute_id = wait.platform_ids["execute_id"]
    assert wait.prompt == WaitingCoze.PROMPT and wait.code == "waiting_human"
    assert wait.resume == {"platform": "coze", "workflow_id": "7391", "event_id": f"{execute_id}/1",
                           "interrupt_type": 2, "node_title": "Question", "execute_id": execute_id}


def test_answering_the_coze_question_resumes_the_run_once_and_reads_its_answer(coze, session):
    connector, stage_call, wait = coze_wait(coze, session)
    done = connector.resume(stage_call, roundtrip(wait.resume), Decision(True, output="EMEA"), session)
    assert isinstance(done, Done) and done.answer.output == {"count": 3, "answer": "EMEA"}
    sent = coze.resume_calls[0].json
    assert sent == {"workflow_id": "7391", "event_id": wait.resume["event_id"], "resume_data": "EMEA",
                    "interrupt_type": 2}
    again = connector.resume(stage_call, wait.resume, Decision(True, output="EMEA"), session)
    assert isinstance(again, Done) and again.answer == done.answer  # "not interrupted": the history answers
    assert coze.resumed[wait.platform_ids["execute_id"]] == 1


def test_a_coze_rejection_is_not_resumed(coze, session):
    connector, stage_call, wait = coze_wait(coze, session)
    with pytest.raises(PlatformError) as info:
        connector.resume(stage_call, wait.resume, REJECT, session)
    assert info.value.code == "rejected" and not coze.resume_calls


def test_coze_failing_the_resume_is_retryable_and_resumes_nothing(coze, session):
    connector, stage_call, wait = coze_wait(coze, session)
    coze.resume_fail = 1
    with pytest.raises(PlatformError) as info:
        connector.resume(stage_call, wait.resume, APPROVE, session)
    assert info.value.retry is Retry.RETRYABLE and "still interrupted" in info.value.message
    assert not coze.resumed
    assert isinstance(connector.resume(stage_call, wait.resume, APPROVE, session), Done)


def test_a_coze_resume_whose_stream_hangs_is_known_from_the_history(coze, session):
    connector, stage_call, wait = coze_wait(coze, session, timeout_s=0.5)
    coze.resume_hang_s = 1.0
    outcome = connector.resume(stage_call, wait.resume, APPROVE, session)
    done = follow(connector, stage_call, outcome, session, timeout_s=5, interval_s=0.05)
    assert isinstance(done, Done) and done.answer.output["answer"] == "looks right"
    assert coze.resumed[wait.platform_ids["execute_id"]] == 1


def test_a_sync_coze_question_says_how_to_answer_it(coze, session):
    coze.plan("question")
    stage_call = call({"type": "coze", "base_url": coze.base_url, "token_secret": "TOKEN",
                       "workflow_id": "7391", "studio": True}, {"token_secret": COZE_TOKEN})
    with pytest.raises(PlatformError) as info:
        get_connector("coze").trigger(stage_call, session)
    assert info.value.code == "waiting_human" and getattr(info.value, "resume", None) is None


def test_every_wait_names_the_poll_handle_that_watches_its_run(n8n, dify, coze, session):
    _, _, n8n_waiting = n8n_wait(n8n, session)
    _, _, dify_waiting = dify_wait(dify, session)
    _, _, coze_waiting = coze_wait(coze, session)
    assert n8n_waiting.watch == {"execution_id": n8n_waiting.resume["execution_id"]}
    assert dify_waiting.watch == {"run_id": dify_waiting.resume["workflow_run_id"]}
    assert coze_waiting.watch == {"execute_id": coze_waiting.resume["execute_id"]}


def test_the_n8n_resume_carries_the_targets_webhook_credential(n8n, session):
    n8n.plan("wait_webhook")
    connector = get_connector("n8n")
    stage_call = call({"type": "n8n", "url": n8n.url, "api_url": n8n.base_url, "api_key_secret": "KEY",
                       "auth_secret": "HOOK"}, {"api_key_secret": N8N_API_KEY, "auth_secret": "hook-s3cret"})
    wait = waiting(connector, stage_call, connector.trigger(stage_call, session).handle, session)
    connector.resume(stage_call, wait.resume, APPROVE, session)
    assert n8n.resume_calls[0].headers["X-N8N-Auth"] == "hook-s3cret"  # a Wait node may check it too
