"""The web console (issue 16, item 5) in a real headless browser: Debian's chromium through selenium.

The app runs on a real socket (werkzeug, threaded) against the fixture Redis; the browser signs in with a
tenant token, filters the jobs list, opens jobs, pauses and resumes one, sees a migration refused with
its problem, a failed batch's error, another tenant's job as a 404, and signs out. A form posted without
the session's CSRF token is refused (sent with requests and the browser's session cookie).

No skip when the browser is absent: CI installs it (.ci/run), and a missing browser must fail loudly
rather than let the console go untested.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
import requests

from gateway.console.sessions import COOKIE
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest
from tests.conftest import OTHER_TOKEN, TOKEN

CHROMIUM = os.environ.get("BATCHGATE_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("BATCHGATE_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
WAIT_S = 15


def chromium_driver():
    """A headless chromium session; fails (never skips) when Debian's chromium or its driver is absent."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(f"the console's browser test needs Debian's chromium and its driver "
                    f"({', '.join(missing)} not found): apt-get install -y chromium chromium-driver",
                    pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


@pytest.fixture
def console(settings, redis_client):
    """The gateway app (API and console) on a real loopback socket; yields its base URL."""
    from gateway.api.app import create_app
    from tests.http import serve_app

    base, stop = serve_app(create_app(settings, redis_client))
    yield base
    stop()


@pytest.fixture
def browser():
    driver = chromium_driver()
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def register(registry, tenant, flow_id, versions, count=30, **extra):
    for version, stages in versions.items():
        registry.register(tenant, parse_flow({
            "id": flow_id, "version": version, "stages": [{"name": s} for s in stages],
            "batching": {"max_items": 3}, "source": {"type": "sequence", "count": count}, **extra}))


def wait_for(driver, predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception:  # the page is between renders
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; page: {driver.current_url}\n"
                         f"{driver.find_element('tag name', 'body').text[:2000]}")


def session_cookie(driver) -> dict:
    """The console's session cookie as the browser holds it. chromedriver looks cookies up for the URL of
    the document it sees as current; asked right after the sign-in's 303 lands, it can still be looking at
    the navigation's previous document and answers "no such cookie" (a CI run saw exactly that while the
    server had already served /console/jobs to that cookie). So wait for it, as for anything else."""
    return wait_for(driver, lambda: driver.get_cookie(COOKIE), "the console's session cookie")


def text_of(driver, css: str) -> str:
    return driver.find_element("css selector", css).text


def sign_in(driver, base: str, token: str) -> None:
    driver.get(f"{base}/console/jobs")
    wait_for(driver, lambda: "/console/sign-in" in driver.current_url, "the sign-in page")
    driver.find_element("id", "token").send_keys(token)
    driver.find_element("id", "sign-in").click()
    wait_for(driver, lambda: driver.current_url.rstrip("/").endswith("/console/jobs"), "the jobs list")


def click(driver, element_id: str) -> None:
    driver.find_element("id", element_id).click()


@pytest.fixture
def scene(registry, jobs, ledger):
    """Acme: a running job (flow alpha, two versions, the second renames a stage in use) and a job
    with a failed batch (flow beta); globex: one job of its own."""
    register(registry, "acme", "alpha", {"1": ("score", "store"), "2": ("rank", "store")})
    register(registry, "acme", "beta", {"1": ("score",)})
    register(registry, "globex", "alpha", {"1": ("score", "store")})
    running = jobs.create("acme", JobRequest(flow_id="alpha", flow_version="1"))["job_id"]
    broken = jobs.create("acme", JobRequest(flow_id="beta"))["job_id"]
    lease = ledger.lease(broken)
    ledger.fail(broken, lease.seq, lease.lease_token, "platform answered 500: model overloaded",
                retryable=False)
    other = jobs.create("globex", JobRequest(flow_id="alpha"))["job_id"]
    return {"running": running, "broken": broken, "other": other}


def test_a_person_runs_jobs_from_the_console(console, browser, scene, ledger):
    driver, base = browser, console
    sign_in(driver, base, TOKEN)
    cookie = session_cookie(driver)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert TOKEN not in cookie["value"] and TOKEN not in driver.page_source
    assert text_of(driver, "#tenant") == "tenant acme"
    rows = text_of(driver, "#job-rows")
    assert scene["running"] in rows and scene["broken"] in rows
    assert scene["other"] not in driver.page_source  # never another tenant's job

    # filter by flow, then by status
    driver.find_element("id", "flow_id").send_keys("beta")
    click(driver, "apply-filters")
    wait_for(driver, lambda: "flow_id=beta" in driver.current_url, "the flow filter")
    rows = text_of(driver, "#job-rows")
    assert scene["broken"] in rows and scene["running"] not in rows
    driver.get(f"{base}/console/jobs")
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", "status")).select_by_value("running")
    click(driver, "apply-filters")
    wait_for(driver, lambda: "status=running" in driver.current_url, "the status filter")
    rows = text_of(driver, "#job-rows")
    assert scene["running"] in rows and scene["broken"] not in rows

    def commit_next_batch() -> None:  # both stages of the next batch, as a worker elsewhere would
        for _ in range(2):
            lease = ledger.lease(scene["running"])
            ledger.complete(scene["running"], lease.seq, lease.lease_token, {"ok": True})

    # the list's rows are live: a batch committed elsewhere shows up without a reload
    commit_next_batch()
    wait_for(driver, lambda: "3 / 30" in text_of(driver, f'tr[data-job="{scene["running"]}"]'),
             "the list's live progress")

    # open the running job; its progress is live too
    driver.find_element("link text", scene["running"]).click()
    wait_for(driver, lambda: text_of(driver, "#job-id") == scene["running"], "the job page")
    assert text_of(driver, "#job-status") == "running" and text_of(driver, "#items").startswith("3 / 30")
    commit_next_batch()
    wait_for(driver, lambda: text_of(driver, "#items").startswith("6 / 30"), "the job's live progress")
    driver.refresh()  # the batch list is not live: the page as it is now
    first = driver.find_element("css selector", "#batches tbody tr").text.split()
    assert first[:4] == ["0", "completed", "store", "3"]  # batch 0: status, stage, its 3 items

    # pause; a migration to a version that renames a stage in use is refused, with its problem shown
    click(driver, "do-pause")
    wait_for(driver, lambda: text_of(driver, "#notice") == "Paused.", "the pause notice")
    assert text_of(driver, "#job-status") == "paused"
    Select(driver.find_element("id", "flow-version-input")).select_by_value("2")
    driver.find_element("id", "migrate-reason").send_keys("rename score")
    click(driver, "do-migrate")
    problem = wait_for(driver, lambda: text_of(driver, "#problem"), "the migration's problem")
    assert "409" in problem and "incompatible" in problem and "score" in problem
    assert text_of(driver, "#flow-version") == "1" and text_of(driver, "#job-status") == "paused"
    assert driver.find_element("id", "migrate-reason").get_attribute("value") == "rename score"

    click(driver, "do-resume")
    wait_for(driver, lambda: text_of(driver, "#notice") == "Resumed.", "the resume notice")
    assert text_of(driver, "#job-status") == "running"
    audit = text_of(driver, "#audit")
    assert "paused" in audit and "tenant:acme (console)" in audit

    # the job with a failed batch shows the batch's error and attempts
    driver.get(f"{base}/console/jobs/{scene['broken']}")
    failed = wait_for(driver, lambda: text_of(driver, "#failed-batches"), "the failed batches")
    assert "model overloaded" in failed and "score" in failed
    driver.find_element("css selector", "#failed-batches tbody a").click()  # the batch in full
    wait_for(driver, lambda: text_of(driver, "#batch-title") == "Batch 0", "the batch page")
    assert "model overloaded" in text_of(driver, "#batch-error")
    assert text_of(driver, "#batch-status") == "failed"

    # another tenant's job is a 404, the same page as a job that never existed
    driver.get(f"{base}/console/jobs/{scene['other']}")
    assert "404" in text_of(driver, "#problem") and "Not Found" in text_of(driver, "#problem").title()
    driver.get(f"{base}/console/jobs/job_doesnotexist")
    assert "404" in text_of(driver, "#problem")

    # a form post without (or with a wrong) CSRF token is refused, and changes nothing
    jar = {COOKIE: session_cookie(driver)["value"]}
    pause_url = f"{base}/console/jobs/{scene['running']}/pause"
    for data in ({}, {"csrf": "x" * 43}):
        resp = requests.post(pause_url, data=data, cookies=jar, allow_redirects=False, timeout=10)
        assert resp.status_code == 403 and "CSRF" in resp.text
    assert ledger.job_fields(scene["running"])["status"] == "running"

    # sign out: the session is gone, the old cookie signs nobody in
    driver.get(f"{base}/console/jobs")
    click(driver, "sign-out")
    wait_for(driver, lambda: "/console/sign-in" in driver.current_url, "the sign-in page")
    driver.get(f"{base}/console/jobs")
    assert "/console/sign-in" in driver.current_url
    resp = requests.get(f"{base}/console/jobs", cookies=jar, allow_redirects=False, timeout=10)
    assert resp.status_code == 303 and "/console/sign-in" in resp.headers["Location"]
    assert not ledger.r.keys("*console:session*")


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def signed_in(base: str, token: str = TOKEN) -> requests.Session:
    http = requests.Session()
    resp = http.post(f"{base}/console/sign-in", data={"token": token}, timeout=10)
    assert resp.status_code == 200 and resp.url.endswith("/console/jobs"), resp.text[:500]
    return http


def test_an_action_on_a_job_that_changed_meanwhile_shows_the_problem(console, scene, ledger):
    http = signed_in(console)
    page = http.get(f"{console}/console/jobs/{scene['running']}", timeout=10)
    assert page.status_code == 200
    ledger.cancel(scene["running"], "tenant:acme", "stopped from the API")  # while the page is open
    resp = http.post(f"{console}/console/jobs/{scene['running']}/pause", data={"csrf": csrf_of(page.text)},
                     timeout=10)
    assert resp.status_code == 409 and resp.headers["Content-Type"].startswith("text/html")
    assert "is cancelled" in resp.text and 'id="problem"' in resp.text
    resp = http.post(f"{console}/console/jobs/{scene['running']}/resume-cursor",
                     data={"csrf": csrf_of(page.text), "cursor": "{not json"}, timeout=10)
    assert resp.status_code == 400 and "not valid JSON" in resp.text


def test_sign_in_refuses_a_bad_token_another_site_and_a_revoked_token(console, settings, scene):
    resp = requests.post(f"{console}/console/sign-in", data={"token": "t-nobody-000000"}, timeout=10)
    assert resp.status_code == 401 and "not one batchgate knows" in resp.text
    resp = requests.post(f"{console}/console/sign-in", data={"token": TOKEN}, timeout=10,
                         headers={"Origin": "https://evil.example"}, allow_redirects=False)
    assert resp.status_code == 403 and "Set-Cookie" not in resp.headers
    http = signed_in(console, OTHER_TOKEN)
    assert scene["other"] in http.get(f"{console}/console/jobs", timeout=10).text
    del settings.tokens[OTHER_TOKEN]  # the operator revokes globex's token: its sessions end
    resp = http.get(f"{console}/console/jobs", allow_redirects=False, timeout=10)
    assert resp.status_code == 303 and "/console/sign-in" in resp.headers["Location"]


def test_pages_are_not_cached_framed_or_scripted_inline(console, scene):
    http = signed_in(console)
    resp = http.get(f"{console}/console/jobs/{scene['running']}", timeout=10)
    assert resp.headers["Cache-Control"] == "no-store" and resp.headers["X-Frame-Options"] == "DENY"
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert "<script>" not in resp.text and " style=" not in resp.text
    for name, kind in (("console.css", "text/css"), ("console.js", "text/javascript")):
        static = requests.get(f"{console}/console/static/{name}", timeout=10)  # no session needed
        assert static.status_code == 200 and static.headers["Content-Type"].startswith(kind)
    typo = http.get(f"{console}/console/jbos", timeout=10)
    assert typo.status_code == 404 and typo.headers["Content-Type"].startswith("text/html")
    poll = http.get(f"{console}/console/jobs/{scene['running']}/live", timeout=10)
    assert poll.status_code == 200 and 'id="job-status"' in poll.text
    signed_out = requests.get(f"{console}/console/jobs/{scene['running']}/live", timeout=10,
                              headers={"X-Console-Poll": "1"}, allow_redirects=False)
    assert signed_out.status_code == 401  # the live region reloads the page, which asks to sign in


def test_jobs_list_pages_with_the_index_cursor_and_its_live_rows_keep_the_page(console, registry, jobs):
    register(registry, "acme", "many", {"1": ("score",)}, count=3)
    made = [jobs.create("acme", JobRequest(flow_id="many"))["job_id"] for _ in range(27)]
    http = signed_in(console)
    first = http.get(f"{console}/console/jobs", params={"flow_id": "many"}, timeout=10)
    shown = set(re.findall(r'data-job="(job_[^"]+)"', first.text))
    assert len(shown) == 25 and shown <= set(made)
    nxt = re.search(r'href="([^"]+)" id="next-page"', first.text).group(1)
    second = http.get(console + nxt.replace("&amp;", "&"), timeout=10)
    rest = set(re.findall(r'data-job="(job_[^"]+)"', second.text))
    assert rest == set(made) - shown and 'id="next-page"' not in second.text
    poll = re.search(r'data-poll="([^"]+)"', second.text).group(1).replace("&amp;", "&")
    rows = http.get(console + poll, headers={"X-Console-Poll": "1"}, timeout=10)
    assert set(re.findall(r'data-job="(job_[^"]+)"', rows.text)) == rest  # the same page, refreshed
    bad = http.get(f"{console}/console/jobs", params={"status": "sleeping"}, timeout=10)
    assert bad.status_code == 422 and 'id="problem"' in bad.text and "status must be one of" in bad.text
    other = http.get(f"{console}/console/jobs", params={"flow_id": "beta", "cursor": nxt.split("cursor=")[1]},
                     timeout=10)
    assert other.status_code == 422 and "other filters" in other.text  # a cursor of another listing


def test_retry_failed_resume_from_a_cursor_and_cancel_from_the_console(console, scene, ledger, redis_client):
    http = signed_in(console)
    page = http.get(f"{console}/console/jobs/{scene['broken']}", timeout=10)
    csrf = csrf_of(page.text)
    job_url = f"{console}/console/jobs/{scene['broken']}"
    resp = http.post(f"{job_url}/retry-failed", data={"csrf": csrf}, timeout=10)
    assert resp.status_code == 200 and "Failed batches re-opened." in resp.text
    assert ledger.job_fields(scene["broken"])["n_failed"] == "0"

    run_url = f"{console}/console/jobs/{scene['running']}"
    resp = http.post(f"{run_url}/resume-cursor", timeout=10,
                     data={"csrf": csrf, "cursor": '{"type": "offset", "offset": 9}', "reason": "skip 9"})
    assert resp.status_code == 200 and "Re-planned from the cursor." in resp.text
    assert "cursor_moved" in resp.text and "skip 9" in resp.text  # the audit trail names it
    resp = http.post(f"{run_url}/cancel", data={"csrf": csrf, "reason": "wrong list"}, timeout=10)
    assert resp.status_code == 200 and "Cancelled." in resp.text
    assert ledger.job_fields(scene["running"])["status"] == "cancelled"
    resp = http.post(f"{run_url}/migrate", data={"csrf": csrf, "flow_version": "2", "reason": ""},
                     timeout=10)
    assert resp.status_code == 422 and "reason" in resp.text  # the API's validation, shown

    session_key = next(iter(redis_client.scan_iter("*console:session:*")))
    assert 12 * 3600 - 60 < redis_client.ttl(session_key) <= 12 * 3600
    assert TOKEN not in str(redis_client.hgetall(session_key))


def test_sign_in_sends_back_to_the_page_asked_for_and_nowhere_else(console, scene):
    http = requests.Session()
    resp = http.get(f"{console}/console/jobs/{scene['running']}", timeout=10)
    assert resp.url.startswith(f"{console}/console/sign-in?next=")
    resp = http.post(f"{console}/console/sign-in", timeout=10,
                     data={"token": TOKEN, "next": f"/console/jobs/{scene['running']}"})
    assert resp.url == f"{console}/console/jobs/{scene['running']}"
    for evil in ("https://evil.example/", "//evil.example/console/", "/console/../v1/jobs"):
        resp = requests.post(f"{console}/console/sign-in", data={"token": TOKEN, "next": evil},
                             allow_redirects=False, timeout=10)
        assert resp.headers["Location"] == "/console/jobs", evil


def test_the_cookie_is_secure_over_https_or_behind_an_https_public_url(settings, redis_client):
    from gateway.api.app import create_app

    app = create_app(settings, redis_client)
    for base_url, secure in (("http://localhost", False), ("https://localhost", True)):
        resp = app.test_client().post("/console/sign-in", data={"token": TOKEN}, base_url=base_url)
        cookie = resp.headers["Set-Cookie"]
        assert resp.status_code == 303 and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert ("; Secure" in cookie) is secure
    https_public = create_app(settings.model_copy(update={"public_url": "https://batchgate.example"}),
                              redis_client)
    resp = https_public.test_client().post("/console/sign-in", data={"token": TOKEN})
    assert "; Secure" in resp.headers["Set-Cookie"]  # TLS ends at a proxy in front


def test_another_tenants_job_is_a_404_on_every_console_route(console, scene, ledger):
    http = signed_in(console)
    csrf = csrf_of(http.get(f"{console}/console/jobs", timeout=10).text)
    other = f"{console}/console/jobs/{scene['other']}"
    assert http.get(f"{other}/live", headers={"X-Console-Poll": "1"}, timeout=10).status_code == 404
    assert http.get(f"{other}/batches/0", timeout=10).status_code == 404
    mine = http.get(f"{console}/console/jobs/{scene['running']}/batches/999", timeout=10)
    assert mine.status_code == 404 and "has no batch 999" in mine.text
    for action in ("pause", "resume", "cancel", "retry-failed", "resume-cursor", "migrate"):
        resp = http.post(f"{other}/{action}", timeout=10,
                         data={"csrf": csrf, "cursor": "{}", "flow_version": "1", "reason": "x"})
        assert resp.status_code == 404, action
        nobody = http.post(f"{console}/console/jobs/job_nobody/{action}", timeout=10,
                           data={"csrf": csrf, "cursor": "{}", "flow_version": "1", "reason": "x"})
        assert resp.text.replace(scene["other"], "ID") == nobody.text.replace("job_nobody", "ID")
    assert ledger.job_fields(scene["other"])["status"] == "running"  # untouched
    assert ledger.r.xlen(ledger.keys.job(scene["other"]).audit) == 1  # only its creation


def test_the_log_pages_back_and_signing_in_again_ends_the_old_session(console, scene, ledger, redis_client):
    from tests.conftest import drain

    drain(ledger, scene["running"])  # 10 batches, 2 stages: over 40 log entries
    http = signed_in(console)
    page = http.get(f"{console}/console/jobs/{scene['running']}", timeout=10)

    def log_ids(html: str) -> list[tuple[int, int]]:
        block = html.split('<ol class="stream" id="log">')[1].split("</ol>")[0]
        return [tuple(map(int, i.split("-"))) for i in re.findall(r'data-id="([0-9-]+)"', block)]

    newest = log_ids(page.text)
    assert len(newest) == 30 and newest == sorted(newest, reverse=True)
    older = re.search(r'href="([^"]+)" id="log-older"', page.text).group(1).replace("&amp;", "&")
    back = http.get(console + older, timeout=10)
    rest = log_ids(back.text)
    assert rest and max(rest) < min(newest)  # the next 30 back, none shown twice
    total = ledger.r.xlen(ledger.keys.job(scene["running"]).log)
    assert len(newest) + len(rest) == min(total, 60)

    assert len(list(redis_client.scan_iter("*console:session:*"))) == 1
    http.post(f"{console}/console/sign-in", data={"token": OTHER_TOKEN}, timeout=10)
    assert len(list(redis_client.scan_iter("*console:session:*"))) == 1  # the acme session is gone
    assert "tenant <strong>globex</strong>" in http.get(f"{console}/console/jobs", timeout=10).text
