"""The console's blueprint, its sign-in and sign-out, the per-request session and CSRF checks, and its
error pages (HTML, never a 500 for a refusal or for Redis being away)."""

from __future__ import annotations

import logging
import re
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import redis
from flask import (
    Blueprint,
    Response,
    current_app,
    g,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.exceptions import HTTPException

from gateway.api.common import Services, app_service, request_services
from gateway.console.sessions import COOKIE, COOKIE_PATH, SESSION_TTL, Session, SessionStore
from gateway.errors import BatchgateError, RetryableError
from gateway.ledger.embedded import REDIS_DOWN
from gateway.security import tenant_for_token

log = logging.getLogger(__name__)
bp = Blueprint("console", __name__, url_prefix="/console", template_folder="templates",
               static_folder="static", static_url_path="/static")

#: Endpoints that need no session: the sign-in page and its form, the static files.
PUBLIC = frozenset({"console.sign_in", "console.sign_in_post", "console.static"})
#: Where a sign-in may send a person back to: a console page, nothing else (no open redirect).
_NEXT = re.compile(r"/console/[A-Za-z0-9_\-/]*(\?[A-Za-z0-9_\-=&%.]*)?")
RETRY_AFTER = timedelta(seconds=2)
#: Content-Security-Policy: scripts and styles from this server's files only, no inline script.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


@dataclass(frozen=True)
class NavItem:
    """One entry of the console's navigation bar."""

    endpoint: str
    label: str
    section: str  # the item is current on every page whose endpoint starts with this
    count: Callable[[str], int] | None = None  # a number shown beside the label, given the tenant


#: The navigation bar. Another page (the approvals inbox) adds its item here when it registers its routes.
NAV: list[NavItem] = [NavItem("console.jobs", "Jobs", "console.job")]


def sessions() -> SessionStore:
    """The app's session store (made on first use)."""
    return app_service("batchgate.console", lambda s: SessionStore(s.redis, s.ledger.keys, s.settings))


def current() -> Session:
    """The signed-in session of this request (set by ``_load_session``)."""
    return g.console_session


def services() -> Services:
    return request_services()


@bp.context_processor
def _nav() -> dict[str, Any]:
    me = g.get("console_session")
    return {"nav_items": NAV, "me": me, "nav_counts": _nav_counts(me) if me else {}}


def _nav_counts(me: Session) -> dict[str, int]:
    """Each counted nav item's number; none when Redis cannot say (the 503 page renders all the same)."""
    counts = {}
    for item in NAV:
        if item.count is not None:
            try:
                counts[item.endpoint] = item.count(me.tenant)
            except redis.RedisError:
                pass
    return counts


@bp.before_request
def _load_session() -> Response | None:
    """Every page but sign-in needs a live session; every POST needs the session's CSRF token."""
    g.console_session = None
    if request.endpoint in PUBLIC:
        return None
    session = sessions().get(request.cookies.get(COOKIE))
    if session is None:
        if request.headers.get("X-Console-Poll"):  # a live region's poll: the page reloads to sign in
            return Response("signed out", status=401, mimetype="text/plain")
        return redirect(url_for("console.sign_in", next=request.full_path.rstrip("?")), code=303)
    g.console_session = session
    g.tenant = session.tenant
    if request.method == "POST" and not session.csrf_ok(request.form.get("csrf")):
        log.warning("console form refused: missing or wrong CSRF token (tenant %s, %s)",
                    session.tenant, request.path)
        return error_page(403, "Forbidden", "This form was not sent from a console page of this "
                          "session (its CSRF token is missing or wrong). Reload the page and try again.")
    startup = current_app.extensions.get("batchgate.startup")
    if request.method == "POST" and startup is not None and not startup.ready(wait_s=5.0):
        raise RetryableError("batchgate is deciding its recovery after a restart; try again shortly",
                             retry_after=timedelta(seconds=1))
    return None


@bp.after_request
def _headers(resp: Response) -> Response:
    resp.headers.setdefault("Content-Security-Policy", CSP)
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "same-origin"
    resp.headers["X-Frame-Options"] = "DENY"
    if request.endpoint != "console.static":
        resp.headers["Cache-Control"] = "no-store"  # a tenant's pages stay out of shared caches
    return resp


@bp.get("/")
def home() -> Response:
    return redirect(url_for("console.jobs"), code=303)


@bp.route("/<path:unknown>", methods=["GET", "POST"])
def no_such_page(unknown: str) -> Response:
    """A mistyped console address is the console's 404 page, not the API's problem document."""
    return error_page(404, "Not Found", "There is no such console page.")


@bp.get("/sign-in")
def sign_in() -> Any:
    if sessions().get(request.cookies.get(COOKIE)) is not None:
        return redirect(url_for("console.jobs"), code=303)
    return render_template("console/sign_in.html", next=_safe_next(request.args.get("next")))


@bp.post("/sign-in")
def sign_in_post() -> Any:
    """Check the token once; the session keeps the tenant, never the token (sessions.py)."""
    if not _same_origin():
        return error_page(403, "Forbidden", "The sign-in form must be sent from this console.")
    token = request.form.get("token", "")
    nxt = _safe_next(request.form.get("next"))
    tenant = tenant_for_token(services().settings.token_map(), token) if 0 < len(token) <= 1000 else None
    if tenant is None:
        return render_template("console/sign_in.html", next=nxt,
                               error="That token is not one batchgate knows."), 401
    previous = request.cookies.get(COOKIE)
    if previous:
        sessions().delete(previous)  # signing in again (as another tenant, say) ends the old session
    session = sessions().create(tenant, token)
    log.info("console sign-in tenant=%s", tenant)
    resp = redirect(nxt or url_for("console.jobs"), code=303)
    resp.set_cookie(COOKIE, session.session_id, max_age=int(SESSION_TTL.total_seconds()), path=COOKIE_PATH,
                    secure=_https(), httponly=True, samesite="Strict")
    return resp


@bp.post("/sign-out")
def sign_out() -> Response:
    sessions().delete(current().session_id)
    log.info("console sign-out tenant=%s", current().tenant)
    resp = redirect(url_for("console.sign_in"), code=303)
    resp.delete_cookie(COOKIE, path=COOKIE_PATH, secure=_https(), httponly=True, samesite="Strict")
    return resp


def _https() -> bool:
    """Secure cookies when the request came over https (or batchgate's public URL is https)."""
    public = services().settings.public_url or ""
    return request.is_secure or public.startswith("https://")


def _same_origin() -> bool:
    """A browser names the site a form came from (Origin); another site's page is refused. The host is
    compared, not the scheme: behind a proxy that ends TLS the request itself arrives over http."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == request.host.lower()


def _safe_next(value: str | None) -> str | None:
    return value if value and len(value) < 500 and _NEXT.fullmatch(value) else None


def error_page(status: int, title: str, detail: str, problem: dict[str, Any] | None = None) -> Response:
    """An HTML error page (the console's answer where the API answers a problem document)."""
    resp = make_response(render_template("console/error.html", status=status, title=title, detail=detail,
                                         problem=problem), status)
    return resp


@bp.errorhandler(BatchgateError)
def _refused(exc: BatchgateError) -> Response:
    resp = error_page(exc.status, exc.title, exc.detail, exc.problem())
    if isinstance(exc, RetryableError) and exc.retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, int(exc.retry_after.total_seconds())))
    return resp


@bp.errorhandler(HTTPException)
def _http(exc: HTTPException) -> Response:
    return error_page(exc.code or 500, exc.name, exc.description or exc.name)


def _redis_down(exc: Exception) -> Response:
    log.warning("ledger redis unavailable on console %s %s: %s", request.method, request.path,
                type(exc).__name__)
    resp = error_page(503, "Temporarily unavailable",
                      "batchgate's Redis cannot be reached right now (down, restarting or loading its "
                      "data). Nothing was changed; reload the page in a few seconds.")
    resp.headers["Retry-After"] = str(int(RETRY_AFTER.total_seconds()))
    return resp


for _down in REDIS_DOWN:  # down, restarting, loading its AOF, a cluster failing over
    bp.register_error_handler(_down, _redis_down)


@bp.errorhandler(Exception)
def _unexpected(exc: Exception) -> Response:
    error_id = uuid.uuid4().hex
    log.error("unhandled %s on console %s %s (error %s)\n%s", type(exc).__name__, request.method,
              request.path, error_id, "".join(traceback.format_exception(exc)).rstrip())
    return error_page(500, "Internal error", f"An unexpected error occurred; it has been logged as "
                      f"error {error_id}.")
