"""The console's approvals inbox (issue 16, item 5): in Debian's headless chromium a person opens the
inbox from the nav bar, edits a batch's output and approves it (the next stage is leased with the edited
output), rejects another (the job counts the failure), follows the job page to its pending approvals;
a form posted without the CSRF token is refused and another tenant's approval is the 404 page. Without
the browser: output that is not JSON, a decision made elsewhere meanwhile (409), a cancelled job and a
person who is not an approver are each shown as the problem on the page, and nothing is decided.
"""

from __future__ import annotations

import re

import pytest
import requests

from gateway.console.sessions import COOKIE
from tests.conftest import OTHER_TOKEN, TOKEN
from tests.test_console import (
    browser,
    click,
    console,
    csrf_of,
    session_cookie,
    sign_in,
    signed_in,
    text_of,
    wait_for,
)

__all__ = ["browser", "console"]  # the fixtures, shared with test_console.py


def review_stages(approvers=None):
    approval = {"timeout": 3600, "show": "score"}
    if approvers is not None:
        approval["approvers"] = approvers
    return [{"name": "score"}, {"name": "review", "approval": approval}, {"name": "store"}]


def score_all(ledger, job_id) -> dict[int, str]:
    """Commit every batch's score stage as a worker would; the approval ids opened, by seq."""
    opened = {}
    while (lease := ledger.lease(job_id)) is not None:
        output = {"score": 10 + lease.seq, "n": len(lease.items)}
        ledger.complete(job_id, lease.seq, lease.lease_token, output)
        opened[lease.seq] = ledger.batch_record(job_id, lease.seq)["approval"]
    return opened


@pytest.fixture
def waiting(ledger, make_job):
    """Acme: a job of 3 batches, each waiting at its review stage; globex: one of its own."""
    job = make_job(items=9, max_items=3, stage_defs=review_stages(), tolerated_failure_percentage=50)
    other = make_job(items=3, max_items=3, stage_defs=review_stages(), tenant="globex")
    return {"job": job, "approvals": score_all(ledger, job), "other": score_all(ledger, other)[0]}


def test_a_person_decides_approvals_in_the_console(console, browser, waiting, ledger):
    driver, base, job = browser, console, waiting["job"]
    ids = waiting["approvals"]
    sign_in(driver, base, TOKEN)
    assert text_of(driver, "#nav-count-approvals") == "3"
    driver.find_element("css selector", 'header nav a[href="/console/approvals"]').click()
    wait_for(driver, lambda: driver.current_url.endswith("/console/approvals"), "the inbox")
    rows = driver.find_elements("css selector", "#approvals tbody tr[data-approval]")
    assert sorted(r.get_attribute("data-approval") for r in rows) == sorted(ids.values())
    assert waiting["other"] not in driver.page_source  # never another tenant's approval
    row = text_of(driver, f'tr[data-approval="{ids[0]}"]')
    assert job in row and "review" in row and "3 items" in row and "anyone of the tenant" in row

    # approve batch 0 with an edited output: the store stage is leased with it as its input
    driver.find_element("css selector", f'tr[data-approval="{ids[0]}"] a').click()
    wait_for(driver, lambda: text_of(driver, "#approval-status") == "pending", "the approval page")
    assert '"score": 10' in text_of(driver, "#shown-output")
    box = driver.find_element("id", "output")
    assert '"score": 10' in box.get_attribute("value")  # prefilled with the shown output
    box.clear()
    box.send_keys('{"score": 10, "n": 3, "checked": "by hand"}')
    driver.find_element("id", "approve-comment").send_keys("fixed the note")
    click(driver, "do-approve")
    wait_for(driver, lambda: text_of(driver, "#approval-status") == "approved", "the approval's decision")
    assert text_of(driver, "#notice").startswith("Approved")
    assert text_of(driver, "#decided-by") == "tenant:acme (console)"
    assert "edited" in text_of(driver, "#decision") and not driver.find_elements("id", "form-approve")
    assert '"checked": "by hand"' in text_of(driver, "#committed-output")
    lease = ledger.lease(job)
    assert (lease.seq, lease.stage, lease.input) == (0, "store", {"score": 10, "n": 3, "checked": "by hand"})

    # reject batch 1 with a comment: the job page counts the failure and one batch still waiting
    driver.get(f"{base}/console/approvals/{ids[1]}")
    driver.find_element("id", "reject-comment").send_keys("scores look wrong")
    click(driver, "do-reject")
    wait_for(driver, lambda: text_of(driver, "#approval-status") == "rejected", "the rejection")
    assert text_of(driver, "#decision-comment") == "scores look wrong"
    assert text_of(driver, "#nav-count-approvals") == "1"
    driver.find_element("link text", job).click()
    wait_for(driver, lambda: text_of(driver, "#job-id") == job, "the job page")
    counts = text_of(driver, "#batch-counts")
    assert "1 failed" in counts and "1 waiting human" in counts
    assert text_of(driver, "#waiting-human").startswith("1 batch waits for a person")
    assert ledger.job_fields(job)["n_failed"] == "1"
    click(driver, "job-approvals")  # the job's pending approvals: batch 2's only
    wait_for(driver, lambda: "job=" in driver.current_url, "the job's approvals")
    rows = driver.find_elements("css selector", "#approvals tbody tr[data-approval]")
    assert [r.get_attribute("data-approval") for r in rows] == [ids[2]]
    driver.get(f"{base}/console/approvals")
    driver.find_element("css selector", "#approval-tabs").find_element("link text", "rejected").click()
    wait_for(driver, lambda: "status=rejected" in driver.current_url, "the rejected tab")
    rows = driver.find_elements("css selector", "#approvals tbody tr[data-approval]")
    assert [r.get_attribute("data-approval") for r in rows] == [ids[1]]
    assert "scores look wrong" in rows[0].text and "tenant:acme (console)" in rows[0].text

    # a decision posted without (or with a wrong) CSRF token is refused and decides nothing
    jar = {COOKIE: session_cookie(driver)["value"]}
    for data in ({"output": "{}"}, {"csrf": "x" * 43, "output": "{}"}):
        resp = requests.post(f"{base}/console/approvals/{ids[2]}/approve", data=data, cookies=jar,
                             allow_redirects=False, timeout=10)
        assert resp.status_code == 403 and "CSRF" in resp.text
    assert ledger.approvals.get("acme", ids[2])["status"] == "pending"

    # another tenant's approval is the same 404 page as one that never existed
    driver.get(f"{base}/console/approvals/{waiting['other']}")
    assert "404" in text_of(driver, "#problem")
    theirs = text_of(driver, "#problem").replace(waiting["other"], "ID")
    driver.get(f"{base}/console/approvals/job_nope.0.1.1")
    assert text_of(driver, "#problem").replace("job_nope.0.1.1", "ID") == theirs
    assert ledger.approvals.get("globex", waiting["other"])["status"] == "pending"


def _approve_form(http, base, approval_id):
    page = http.get(f"{base}/console/approvals/{approval_id}", timeout=10)
    assert page.status_code == 200, page.text[:500]
    return csrf_of(page.text)


def test_output_that_is_not_json_is_shown_and_nothing_is_decided(console, waiting, ledger):
    http, aid = signed_in(console), waiting["approvals"][0]
    csrf = _approve_form(http, console, aid)
    for text, says in (('{"score": 1,', "not valid JSON"), ("   ", "empty"),
                       ('{"a": 1, "a": 2}', "not valid JSON")):
        resp = http.post(f"{console}/console/approvals/{aid}/approve", timeout=10,
                         data={"csrf": csrf, "output": text, "comment": "typo"})
        assert resp.status_code == 422 and 'id="problem"' in resp.text and says in resp.text, text
        assert "Approve refused" in resp.text and "nothing was decided" in resp.text
        assert "JSON (not valid JSON" not in resp.text
        assert re.search(r'<textarea id="output"[^>]*>' + re.escape(text.replace('"', "&#34;")), resp.text)
        assert 'value="typo"' in resp.text  # what was typed is kept
    assert ledger.approvals.get("acme", aid)["status"] == "pending"
    long = http.post(f"{console}/console/approvals/{aid}/reject", timeout=10,
                     data={"csrf": csrf, "comment": "x" * 2001})
    assert long.status_code == 422 and "comment" in long.text
    unchanged = http.post(f"{console}/console/approvals/{aid}/approve", timeout=10,
                          data={"csrf": csrf, "output": '{"n":3,"score":10}'})  # the shown one, reformatted
    assert unchanged.status_code == 200 and "Approved" in unchanged.text
    view = ledger.approvals.get("acme", aid)
    assert view["status"] == "approved" and view["decision"]["edited_output"] is False


def test_a_refused_decision_is_the_problem_on_the_page(console, waiting, ledger, make_job):
    http, ids = signed_in(console), waiting["approvals"]
    csrf = _approve_form(http, console, ids[0])
    ledger.approvals.decide("acme", ids[0], "approve", "tenant:acme")  # from the API, while the page is open
    resp = http.post(f"{console}/console/approvals/{ids[0]}/reject", data={"csrf": csrf, "comment": "no"},
                     timeout=10)
    assert resp.status_code == 409 and resp.headers["Content-Type"].startswith("text/html")
    assert "Reject refused: Approval already decided" in resp.text and 'id="decided-by"' in resp.text
    assert ledger.approvals.get("acme", ids[0])["status"] == "approved"
    again = http.post(f"{console}/console/approvals/{ids[0]}/approve", timeout=10,
                      data={"csrf": csrf, "output": '{"n": 3, "score": 10}'})
    assert again.status_code == 200  # the same decision again: the first one stands, no problem

    guarded = make_job(items=3, max_items=3, stage_defs=review_stages(approvers=["alice"]))
    (gid,) = score_all(ledger, guarded).values()
    resp = http.post(f"{console}/console/approvals/{gid}/approve", timeout=10,
                     data={"csrf": csrf, "output": '{"score": 10, "n": 3}'})
    assert resp.status_code == 403 and "not an approver" in resp.text and "alice" in resp.text
    assert ledger.approvals.get("acme", gid)["status"] == "pending"

    ledger.cancel(waiting["job"], "tenant:acme", "stopped from the API")
    resp = http.post(f"{console}/console/approvals/{ids[1]}/approve", timeout=10,
                     data={"csrf": csrf, "output": "{}"})
    assert resp.status_code == 409 and "is cancelled" in resp.text

    theirs = http.post(f"{console}/console/approvals/{waiting['other']}/approve", timeout=10,
                       data={"csrf": csrf, "output": "{}"})
    nobody = http.post(f"{console}/console/approvals/job_nope.0.1.1/approve", timeout=10,
                       data={"csrf": csrf, "output": "{}"})
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.text.replace(waiting["other"], "ID") == nobody.text.replace("job_nope.0.1.1", "ID")
    assert ledger.approvals.get("globex", waiting["other"])["status"] == "pending"


def test_the_inbox_pages_with_the_listing_cursor(console, ledger, make_job, monkeypatch):
    from gateway.console import approvals as inbox

    monkeypatch.setattr(inbox, "PAGE_SIZE", 2)
    job = make_job(items=15, max_items=3, stage_defs=review_stages())
    made = set(score_all(ledger, job).values())
    http = signed_in(console)
    seen, url, pages = [], f"{console}/console/approvals", 0
    while url:
        page = http.get(url, timeout=10)
        assert page.status_code == 200
        seen += re.findall(r'data-approval="([^"]+)"', page.text)
        nxt = re.search(r'href="([^"]+)" id="next-page"', page.text)
        url = console + nxt.group(1).replace("&amp;", "&") if nxt else None
        pages += 1
    assert sorted(seen) == sorted(made) and pages >= 3
    by_job, url = [], f"{console}/console/approvals?job={job}"
    while url:
        page = http.get(url, timeout=10)
        by_job += re.findall(r'data-approval="([^"]+)"', page.text)
        nxt = re.search(r'href="([^"]+)" id="next-page"', page.text)
        url = console + nxt.group(1).replace("&amp;", "&") if nxt else None
    assert sorted(by_job) == sorted(made)
    for bad in ("status=sleeping", "cursor=garbage"):
        resp = http.get(f"{console}/console/approvals?{bad}", timeout=10)
        assert resp.status_code == 422 and 'id="problem"' in resp.text, bad
    other = signed_in(console, OTHER_TOKEN).get(f"{console}/console/approvals?job={job}", timeout=10)
    assert other.status_code == 404


def test_a_platform_approval_shows_the_platforms_prompt(console, ledger, make_job):
    job = make_job(items=2, max_items=2, stages=("ask",))
    lease = ledger.lease(job)
    opened = ledger.open_platform_approval(job, lease.seq, lease.lease_token,
                                           {"question": "Send the <b>offer</b>?", "to": "ada@example.com"})
    http = signed_in(console)
    page = http.get(f"{console}/console/approvals/{opened['approval_id']}", timeout=10)
    assert page.status_code == 200 and 'id="prompt"' in page.text and 'id="shown-output"' not in page.text
    assert "Send the &lt;b&gt;offer&lt;/b&gt;?" in page.text  # escaped, never markup
    assert "The platform's run goes on" in page.text
    inbox = http.get(f"{console}/console/approvals", timeout=10).text
    assert opened["approval_id"] in inbox and "platform" in inbox
    resp = http.post(f"{console}/console/approvals/{opened['approval_id']}/approve", timeout=10,
                     data={"csrf": csrf_of(page.text), "output": '{"answer": "yes"}'})
    assert resp.status_code == 200 and "Approved" in resp.text
    decided = ledger.approvals.get("acme", opened["approval_id"])
    assert decided["status"] == "approved" and decided["decision"]["edited_output"]


def test_redis_away_while_deciding_is_a_503_page_and_the_approval_waits(tmp_path):
    """Kill the console's Redis with an approval page open: the inbox and the decision are 503 pages
    (never a 500, nothing half-decided); once Redis is back with its data the same form decides."""
    from gateway.api.app import create_app
    from gateway.ledger.embedded import EmbeddedRedis, client_for
    from gateway.ledger.flows import parse_flow
    from gateway.ledger.jobs import JobRequest
    from gateway.settings import Settings
    from tests.http import serve_app

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    app = create_app(Settings(redis_url=url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"}),
                     client_for(url))
    svc = app.extensions["batchgate"]
    svc.flows.register("acme", parse_flow({"id": "gated", "version": "1", "stages": review_stages(),
                                           "batching": {"max_items": 3},
                                           "source": {"type": "sequence", "count": 3}}))
    job = svc.jobs.create("acme", JobRequest(flow_id="gated"))["job_id"]
    (aid,) = score_all(svc.ledger, job).values()
    base, stop = serve_app(app)
    try:
        http = signed_in(base)
        csrf = _approve_form(http, base, aid)
        server.kill()
        for method, path in (("GET", "/console/approvals"), ("GET", f"/console/approvals/{aid}"),
                             ("POST", f"/console/approvals/{aid}/approve")):
            resp = http.request(method, base + path, data={"csrf": csrf, "output": '{"score": 1}'},
                                timeout=10, allow_redirects=False)
            assert resp.status_code == 503 and "cannot be reached" in resp.text, (path, resp.text[:300])
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        assert svc.ledger.approvals.get("acme", aid)["status"] == "pending"
        resp = http.post(f"{base}/console/approvals/{aid}/approve", timeout=10,
                         data={"csrf": csrf, "output": '{"score": 1}'})
        assert resp.status_code == 200 and 'id="decided-by"' in resp.text
        lease = svc.ledger.lease(job)
        assert (lease.stage, lease.input) == ("store", {"score": 1})
    finally:
        stop()
        server.stop()
