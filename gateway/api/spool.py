"""Callbacks that arrive while the ledger's Redis is unavailable: kept on local disk, replayed in order.

Why: platforms post a stage's callback once. n8n's HTTP Request node, Dify's HTTP node and a Coze
plugin call retry only when a flow author turned retries on, and none retries for an hour. A 503 while
Redis restarts (or loads its AOF) lost the answer: the batch's lease then ran out and the stage ran,
and was paid for, again (issue 15: up to 15 paid re-runs in one 5 s Redis outage).

What: when the commit of a verified callback meets an unavailable Redis, the callback route writes the
signed token and the answer to one file under ``<data_dir>/callback-spool`` (written to a temporary
name, fsynced, renamed, the folder fsynced: a file that exists is whole) and answers ``202`` with
``"spooled": true``. A replayer thread commits the spooled answers in arrival order (file names start
with the arrival time in ns) as soon as Redis answers again, through the same commit path as a live
callback: the lease token fences it, so a stale or duplicate answer changes nothing, exactly as it would
have live. An answer the ledger refuses (stale, expired link, cancelled job) is dropped with a log line;
one that fails unexpectedly is kept aside as ``*.failed`` for a person to read, never retried in a loop.

Who replays: every API process starts a replayer when it spools a callback, and at start when the folder
holds files (a restart replays what an earlier process kept). An exclusive ``flock`` on the folder's lock
file lets one process replay at a time; a replayer killed between a commit and the file's removal
replays that answer again later, which the ledger answers as a duplicate.

Limits: the spool is the gateway host's local disk. A host lost with its disk loses what it spooled (the
leases of those batches then run out as before); several gateway hosts each replay their own spool.
Start-up and the lease expiry do not wait for spools: a batch whose lease runs out before Redis returns
and its answer is replayed is re-run, so callback leases keep ``callback_grace`` (1 h by default) beyond
the call.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from gateway.errors import BatchgateError
from gateway.ledger.embedded import REDIS_DOWN as LEDGER_DOWN

log = logging.getLogger(__name__)

#: Unavailable for a commit: down or restarting (embedded.REDIS_DOWN), or a replica after a failover.
REDIS_DOWN = (*LEDGER_DOWN, redis.exceptions.ReadOnlyError)
REPLAY_PAUSE_MIN_S = 0.05
REPLAY_PAUSE_MAX_S = 1.0

Replay = Callable[[str, Any], Any]


class CallbackSpool:
    """A folder of callbacks to commit later, and the thread that commits them."""

    def __init__(self, folder: Path, replay: Replay) -> None:
        self.folder = folder
        self._replay = replay
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stop = threading.Event()

    # -- keeping ---------------------------------------------------------------------------

    def keep(self, token: str, answer: Any) -> str:
        """Write one callback durably; returns its spool id. Raises OSError if the disk refuses."""
        self.folder.mkdir(parents=True, exist_ok=True)
        spool_id = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp = self.folder / f".{spool_id}.tmp"
        data = json.dumps({"token": token, "answer": answer, "received_ms": int(time.time() * 1000)})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.folder / f"{spool_id}.json")
        _fsync_dir(self.folder)
        self.start()
        return spool_id

    def pending(self) -> list[Path]:
        """Spooled callbacks not yet replayed, oldest first."""
        try:
            return sorted(self.folder.glob("*.json"))
        except OSError:
            return []

    # -- replaying -------------------------------------------------------------------------

    def start(self) -> None:
        """Run the replayer thread if callbacks wait and none runs in this process."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if not self.pending():
                return
            self._thread = threading.Thread(target=self._run, name="callback-spool", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        pause = REPLAY_PAUSE_MIN_S
        while not self.stop.is_set():
            try:
                left = self.replay_once()
            except REDIS_DOWN:
                left = True
            except OSError as exc:  # the lock file or folder went away: try again shortly
                log.warning("callback spool: %s", exc)
                left = True
            if not left:
                with self._lock:  # a callback spooled meanwhile starts a new thread once this one ends
                    if not self.pending():
                        self._thread = None
                        return
                pause = REPLAY_PAUSE_MIN_S
                continue
            self.stop.wait(pause)
            pause = min(pause * 2, REPLAY_PAUSE_MAX_S)

    def replay_once(self) -> bool:
        """Replay what is spooled, in order, while Redis answers; True if something is left.

        Raises a REDIS_DOWN error when Redis is still unavailable (nothing is lost: the file stays).
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # another process replays; look again later
            for path in self.pending():
                self._replay_file(path)
        return bool(self.pending())

    def _replay_file(self, path: Path) -> None:
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return  # replayed by a process that held the lock before us
        except (OSError, ValueError) as exc:
            self._set_aside(path, f"unreadable: {exc}")
            return
        try:
            result = self._replay(record["token"], record["answer"])
        except REDIS_DOWN:
            raise
        except BatchgateError as exc:  # refused as a live callback would have been: dropped
            log.warning("spooled callback %s not committed: %s (%s)", path.stem, exc.detail,
                        type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - keep it for a person; never loop on it
            log.exception("spooled callback %s failed to replay", path.stem)
            self._set_aside(path, f"{type(exc).__name__}: {exc}")
            return
        else:
            log.info("spooled callback %s committed after %.1f s (duplicate=%s)", path.stem,
                     time.time() - record.get("received_ms", 0) / 1000,
                     bool(isinstance(result, dict) and result.get("duplicate")))
        path.unlink(missing_ok=True)

    def _set_aside(self, path: Path, why: str) -> None:
        log.error("spooled callback %s set aside as %s.failed: %s", path.stem, path.stem, why)
        try:
            path.replace(path.with_suffix(".failed"))
        except OSError:
            pass


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
