"""Server-sent event streams read as they arrive (Dify's and Coze's streaming runs)."""

from __future__ import annotations

from collections.abc import Iterator

import requests

READ_SIZE = 8192


def frames(resp: requests.Response) -> Iterator[dict[str, str]]:
    """One dict per event frame, as it arrives: its fields (``event``, ``id``, ``data`` with data lines
    joined by newlines); comments and empty frames are skipped."""
    fields: dict[str, str] = {}
    for line in lines(resp):
        if not line:
            if fields:
                yield fields
            fields = {}
            continue
        if line.startswith(b":"):
            continue
        name, _, value = line.decode("utf-8", "replace").partition(":")
        value = value.removeprefix(" ")
        fields[name] = f"{fields[name]}\n{value}" if name == "data" and name in fields else value
    if fields:
        yield fields


def lines(resp: requests.Response) -> Iterator[bytes]:
    """Body lines without their line ends, each as soon as it is complete."""
    buffer = bytearray()
    for chunk in _chunks(resp):
        scan_from = len(buffer)
        buffer += chunk
        while (end := buffer.find(b"\n", scan_from)) >= 0:
            line = bytes(buffer[:end]).rstrip(b"\r")
            del buffer[:end + 1]
            scan_from = 0
            yield line
    if buffer:
        yield bytes(buffer).rstrip(b"\r")


def _chunks(resp: requests.Response) -> Iterator[bytes]:
    """Body bytes as soon as they arrive, whatever the framing (chunked or not)."""
    read1 = getattr(resp.raw, "read1", None)
    if read1 is None:  # urllib3 < 2: one byte at a time is slow but never waits for a full buffer
        yield from resp.iter_content(chunk_size=1)
        return
    while chunk := read1(READ_SIZE):
        yield chunk
