"""Start a demo stack (a private Redis, the app on loopback), make a few jobs in different states, and
save PNGs of the console's pages to docs/console/ with headless chromium (scripts/console_screenshots).

The jobs are driven through the ledger directly (lease, complete, fail), as a worker would, so the pages
show real progress, a failed batch and a refused migration without any platform.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import Select
from werkzeug.serving import make_server

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.api.app import create_app  # noqa: E402
from gateway.ledger.embedded import EmbeddedRedis, client_for  # noqa: E402
from gateway.ledger.flows import parse_flow  # noqa: E402
from gateway.ledger.jobs import JobRequest  # noqa: E402
from gateway.settings import Settings  # noqa: E402

TOKEN = "demo-console-token-0123456789"
WIDTH = 1280


def flow(flow_id: str, version: str, stages: list[str | dict], count: int, **extra) -> object:
    return parse_flow({"id": flow_id, "version": version,
                       "stages": [s if isinstance(s, dict) else {"name": s} for s in stages],
                       "batching": {"max_items": 10}, "source": {"type": "sequence", "count": count},
                       **extra})


def advance(ledger, job_id: str, leases: int, fail_every: int = 0) -> None:
    """Lease and complete (or fail, every ``fail_every``-th) ``leases`` stage runs, as a worker would."""
    for n in range(1, leases + 1):
        lease = ledger.lease(job_id)
        if lease is None:
            return
        if fail_every and n % fail_every == 0:
            ledger.fail(job_id, lease.seq, lease.lease_token,
                        "platform answered 502 Bad Gateway: upstream model timed out after 60 s",
                        retryable=False)
        else:
            scores = [{"item": n, "score": 0.8, "reason": "strong match"} for n in range(3)]
            ledger.complete(job_id, lease.seq, lease.lease_token, {"scores": scores})


def demo_jobs(app) -> dict[str, str]:
    services = app.extensions["batchgate"]
    ledger, jobs, registry = services.ledger, services.jobs, services.flows
    registry.register("acme", flow("resume-screening", "1", ["score", "shortlist", "store"], 500,
                                   tolerated_failure_percentage=10))
    registry.register("acme", flow("resume-screening", "2", ["rank", "shortlist", "store"], 500,
                                   tolerated_failure_percentage=10))
    registry.register("acme", flow("enrich-leads", "3", ["lookup", "store"], 120))
    registry.register("acme", flow("translate-faq", "1", ["translate"], 60))
    made = {}
    made["done"] = jobs.create("acme", JobRequest(flow_id="translate-faq"))["job_id"]
    advance(ledger, made["done"], 100)
    made["cancelled"] = jobs.create("acme", JobRequest(flow_id="enrich-leads"))["job_id"]
    advance(ledger, made["cancelled"], 5)
    ledger.cancel(made["cancelled"], "tenant:acme", "wrong lead list")
    made["paused"] = jobs.create("acme", JobRequest(flow_id="enrich-leads"))["job_id"]
    advance(ledger, made["paused"], 9)
    ledger.pause(made["paused"], "tenant:acme")
    made["main"] = jobs.create("acme", JobRequest(flow_id="resume-screening", flow_version="1"))["job_id"]
    advance(ledger, made["main"], 70, fail_every=23)
    made["fresh"] = jobs.create("acme", JobRequest(flow_id="resume-screening", flow_version="1"))["job_id"]
    advance(ledger, made["fresh"], 12)
    made["review"] = review_job(ledger, jobs, registry)
    return made


def review_job(ledger, jobs, registry) -> str:
    """A job whose batches wait at an approval stage (a person checks the shortlist before emails go
    out): four pending, one approved with an edited output."""
    review = {"name": "review", "approval": {"timeout": 86400, "show": "shortlist", "on_timeout": "reject"}}
    registry.register("acme", flow("outreach", "1", ["shortlist", review, "email"], 50,
                                   tolerated_failure_percentage=20))
    job_id = jobs.create("acme", JobRequest(flow_id="outreach"))["job_id"]
    names = ["Ada Byron", "Grace Hopper", "Alan Turing", "Edsger Dijkstra", "Barbara Liskov"]
    while (lease := ledger.lease(job_id)) is not None:
        picks = [{"candidate": names[(lease.seq + i) % 5], "score": round(0.91 - 0.07 * i, 2),
                  "reason": "ten years of distributed systems" if i == 0 else "strong match on skills"}
                 for i in range(3)]
        ledger.complete(job_id, lease.seq, lease.lease_token, {"shortlist": picks, "template": "intro-v2"})
    first = ledger.batch_record(job_id, 0)["approval"]
    ledger.approvals.decide("acme", first, "approve", "tenant:acme (console)", comment="dropped one",
                            output={"shortlist": [], "template": "intro-v2"})
    return job_id


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},900", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)


def shoot(driver, path: Path, full: bool = True) -> None:
    if full:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        chrome = driver.execute_script("return window.outerHeight - window.innerHeight")
        driver.set_window_size(WIDTH, max(600, min(height + 20 + chrome, 4000)))
    time.sleep(0.3)
    driver.save_screenshot(str(path))
    driver.set_window_size(WIDTH, 900)
    print(f"saved {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "console")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis")
        url = redis.start()
        server = None
        driver = None
        try:
            settings = Settings(redis_url=url, data_dir=Path(tmp) / "data", tokens={TOKEN: "acme"})
            app = create_app(settings, client_for(url))
            made = demo_jobs(app)
            server = make_server("127.0.0.1", 0, app, threaded=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            base = f"http://127.0.0.1:{server.server_port}"
            driver = browser()
            driver.get(f"{base}/console/sign-in")
            shoot(driver, out / "sign-in.png", full=False)
            driver.find_element("id", "token").send_keys(TOKEN)
            driver.find_element("id", "sign-in").click()
            time.sleep(0.5)
            shoot(driver, out / "jobs.png")
            driver.get(f"{base}/console/jobs/{made['main']}")
            shoot(driver, out / "job.png")
            driver.get(f"{base}/console/jobs/{made['main']}/batches/7")
            shoot(driver, out / "batch.png", full=False)
            driver.get(f"{base}/console/jobs/{made['main']}")
            driver.find_element("id", "do-pause").click()
            time.sleep(0.3)
            Select(driver.find_element("id", "flow-version-input")).select_by_value("2")
            driver.find_element("id", "migrate-reason").send_keys("rename score to rank")
            driver.find_element("id", "do-migrate").click()
            time.sleep(0.3)
            shoot(driver, out / "migrate-refused.png", full=False)
            driver.get(f"{base}/console/approvals")
            shoot(driver, out / "approvals.png")
            driver.get(f"{base}/console/approvals/{made['review']}.1.1.1")
            shoot(driver, out / "approval.png")
        finally:
            if driver is not None:
                driver.quit()
            if server is not None:
                server.shutdown()
            redis.stop()


if __name__ == "__main__":
    main()
