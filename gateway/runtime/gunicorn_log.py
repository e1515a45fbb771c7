"""gunicorn's logger for ``batchgate serve``: its error log and the access log in batchgate's format.

The access log is on (``serve`` passes ``--access-logfile -``: stdout) and each line carries the method,
the path with signed tokens cut (``/v1/callbacks/<token>`` would hand anyone reading the log the power to
post a platform's answer), the status, the duration and the bytes sent; never the query string or a
header. With ``BATCHGATE_LOG_FORMAT=json`` both logs are JSON lines like every other batchgate log line,
and both go through the same redaction of configured secrets.
"""

from __future__ import annotations

import logging
from typing import Any

from gunicorn import glogging

from gateway.logs import formatter, redact_paths, secret_values
from gateway.settings import Settings


class Logger(glogging.Logger):
    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        try:
            settings = Settings()
            fmt = formatter(settings.log_format, [*secret_values(settings), *settings.token_map()])
        except Exception:  # noqa: BLE001 - serve checked the settings; never stop gunicorn over its log
            return
        for log in (self.error_log, self.access_log):
            for handler in log.handlers:
                handler.setFormatter(fmt)

    def access(self, resp: Any, req: Any, environ: dict, request_time: Any) -> None:
        if not self.access_log_enabled:
            return
        path = redact_paths(environ.get("PATH_INFO") or getattr(req, "path", "") or "")
        status = getattr(resp, "status_code", None) or str(getattr(resp, "status", "-")).split(" ")[0]
        ms = round(request_time.total_seconds() * 1000, 1)
        remote = environ.get("REMOTE_ADDR") or "-"
        sent = getattr(resp, "sent", None)
        try:
            self.access_log.log(logging.INFO, "%s %s %s %s %s ms", remote, environ.get("REQUEST_METHOD"),
                                path, status, ms,
                                extra={"method": environ.get("REQUEST_METHOD"), "path": path,
                                       "status": int(status) if str(status).isdigit() else status,
                                       "duration_ms": ms, "remote": remote, "bytes": sent})
        except Exception:  # noqa: BLE001 - as gunicorn's own access()
            self.exception("access log line failed")
