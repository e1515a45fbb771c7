"""Opening local source files safely: confined to roots, regular files only, never /proc, /dev or /sys.

A path is resolved (symlinks included) and checked before it is opened; the opened descriptor is checked
again (it must be the regular file that was checked, and on Linux its kernel path must pass the same
checks), so a symlink swapped in between the check and the open is refused rather than followed.
Error messages name the rule and the path as given, never the resolved path or any file content.
"""

from __future__ import annotations

import csv
import errno
import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chunker.errors import SourceReadError, SourceSpecError

#: Directories no source may read, whatever the roots say (a root of "/" included).
SYSTEM_DIRS = ("/proc", "/dev", "/sys")
#: Filesystem types refused wherever they are mounted (a bind mount of /proc inside a root).
_PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "debugfs", "securityfs", "tracefs",
                        "configfs", "cgroup", "cgroup2", "efivarfs", "bpf", "fusectl", "pstore", "mqueue"})
#: Default longest line (jsonl) or record (csv) a file source reads, in bytes.
DEFAULT_MAX_RECORD_BYTES = 1024 * 1024

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0)
_csv_limit_lock = threading.Lock()


class FileAccessError(SourceSpecError):
    """A local path a source may not read: file sources off, outside the roots, a system directory,
    or not a regular file. Not retryable: the spec (or the server's roots) must change first."""


@dataclass(frozen=True)
class FileAccess:
    """Which local files path sources may read, and how long a record may be.

    Attributes:
        roots: Directories paths must resolve into; None = any directory (a trusted caller);
            empty = file paths are off.
        deny: Further directories never read, even inside a root (e.g. the server's data directory).
        max_record_bytes: Cap on a spec's max_record_bytes; None = no cap.
    """

    roots: tuple[str, ...] | None = None
    deny: tuple[str, ...] = ()
    max_record_bytes: int | None = None

    def record_limit(self, spec: dict) -> int:
        """The longest line or record a source with this spec may read, in bytes."""
        wanted = spec.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES)
        return wanted if self.max_record_bytes is None else min(wanted, self.max_record_bytes)


UNCONFINED = FileAccess()


def _inside(path: str, dirs: Sequence[str]) -> str | None:
    """The first of dirs that contains path (both resolved), else None."""
    p = Path(path)
    for d in dirs:
        if p.is_relative_to(d):
            return d
    return None


def _realpath(path: str, label: str) -> str:
    """os.path.realpath, FileAccessError when the path changes under it.

    realpath lstat()s a component and then readlink()s it: a symlink swapped for a file in between makes
    readlink fail (EINVAL), and a component swapped mid-walk can fail other ways. Tried a few times,
    then refused as a path that keeps changing (never an unexpected OSError).
    """
    for _ in range(3):
        try:
            return os.path.realpath(path)
        except OSError:
            continue
    raise FileAccessError(f"{label} changed while it was checked; try again once it is stable")


def _resolved(dirs: Sequence[str]) -> list[str]:
    return [_realpath(d, "a source root") for d in dirs]


def check_path(path: str, access: FileAccess) -> str:
    """Checks the rules that need no file to exist; returns the resolved path.

    Raises:
        FileAccessError: If the path may not be read under access.
    """
    if access.roots is not None and not access.roots:
        raise FileAccessError(f"path {path!r}: file sources are off (no source roots are configured)")
    if access.roots is not None and not os.path.isabs(path):
        raise FileAccessError(f"path {path!r} must be absolute")
    if "\x00" in path:
        raise FileAccessError("path must not contain NUL characters")
    real = _realpath(path, f"path {path!r}")
    system = _inside(real, [*SYSTEM_DIRS, *_resolved(SYSTEM_DIRS)])
    if system is not None:
        raise FileAccessError(f"path {path!r} is in {system}, which sources may never read")
    if access.deny and _inside(real, _resolved(access.deny)) is not None:
        raise FileAccessError(f"path {path!r} is in the server's data directory, which sources may not read")
    if access.roots is not None and _inside(real, _resolved(access.roots)) is None:
        raise FileAccessError(f"path {path!r} is outside the source roots")
    return real


def _fs_type(st: os.stat_result) -> str | None:
    """The filesystem type of the mount holding st (Linux /proc/self/mountinfo), else None."""
    wanted = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


def _fd_path(fd: int) -> str | None:
    """The kernel's path of an open descriptor (Linux), else None."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _read_error(path: str, exc: OSError) -> SourceReadError:
    permanent = (FileNotFoundError, PermissionError, NotADirectoryError)
    reason = exc.strerror or type(exc).__name__
    return SourceReadError(f"cannot read {path}: {reason}", retryable=not isinstance(exc, permanent))


def open_file(path: str, access: FileAccess) -> tuple[int, os.stat_result]:
    """Opens a local source file for reading after checking it may be read; returns (fd, fstat).

    Raises:
        FileAccessError: If the path may not be read (see check_path), is not a regular file, or
            changed between the check and the open.
        SourceReadError: If the file is missing or cannot be opened (not retryable for a missing
            file or a permission error).
    """
    real = check_path(path, access)
    try:
        before = os.stat(real)
    except OSError as exc:
        raise _read_error(path, exc) from None
    if stat.S_ISDIR(before.st_mode):
        raise FileAccessError(f"path {path!r} is a directory, not a regular file")
    if not stat.S_ISREG(before.st_mode):
        raise FileAccessError(f"path {path!r} is not a regular file (a device, FIFO or socket)")
    try:
        fd = os.open(real, _FLAGS)  # O_NOFOLLOW: a final component swapped for a symlink fails (ELOOP)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise FileAccessError(f"path {path!r} changed while it was opened") from None
        raise _read_error(path, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise FileAccessError(f"path {path!r} changed while it was opened")
        opened = _fd_path(fd)
        if opened is not None and opened != real:  # a directory on the way was swapped for a symlink
            raise FileAccessError(f"path {path!r} changed while it was opened")
        fs_type = _fs_type(st)
        if fs_type in _PSEUDO_FS:
            raise FileAccessError(f"path {path!r} is on a {fs_type} filesystem, which sources may never read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def ensure_csv_field_limit(limit: int) -> None:
    """Raises the csv module's (process-wide) field size limit to at least limit characters.

    Records are bounded in bytes by the line reader before the csv module sees them, so the field
    limit only has to stay out of the way; it is never lowered.
    """
    with _csv_limit_lock:
        if csv.field_size_limit() < limit:
            csv.field_size_limit(limit)
