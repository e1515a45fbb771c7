"""File sources are confined, bounded and never leak, seen through the live API.

A jsonl/csv "path" must resolve (symlinks included) inside the tenant's BATCHGATE_SOURCE_ROOTS (its own
and the shared "*" ones) and outside /proc, /dev, /sys and the data directory, and be a regular file:
anything else is a 422 naming the rule, never a byte of the file, and no job. File sources are off
without roots. The rules hold at flow registration, at job creation and at every read (lease). A line
or record longer than max_record_bytes fails the read naming its line, and the reader never holds more
than about max_record_bytes of it, whatever the stream (no newline at all, /dev/zero).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import chunker
from chunker.localfiles import FileAccess, FileAccessError, check_path, open_file
from gateway.api.app import create_app
from tests.chunker.helpers import Server
from tests.conftest import OTHER_TOKEN, TOKEN
from tests.http import ApiClient, serve_app

MIB = 1024 * 1024
CANARY = "canary-3f9a1c0e5b"  # put in this process's environment: /proc/self/environ would show it


# -- helpers ---------------------------------------------------------------------------------------

@pytest.fixture
def serve_with(settings, redis_client):
    """serve_with(**changes) -> an ApiClient (acme's token) for the app under changed settings."""
    stops = []

    def start(**changes) -> ApiClient:
        base, stop = serve_app(create_app(settings.model_copy(update=changes), redis_client))
        stops.append(stop)
        return ApiClient(base, TOKEN)

    yield start
    for stop in stops:
        stop()


def register(api, flow_id="files", max_items=2, source=None, retry=None) -> None:
    stage = {"name": "s"} | ({"retry": retry} if retry else {})
    flow = {"id": flow_id, "version": "1", "stages": [stage], "batching": {"max_items": max_items}}
    if source is not None:
        flow["source"] = source
    resp = api.post("/v1/flows", json=flow)
    assert resp.status_code == 201, resp.text


def start_job(api, source, flow_id="files"):
    return api.post("/v1/jobs", json={"flow_id": flow_id, "source": source})


def secrets_of(settings) -> list[str]:
    """What must never appear in an answer: tokens, the signing key, /etc/passwd, the environment."""
    return [TOKEN, OTHER_TOKEN, settings.signing_secret().decode(), "root:", CANARY, "PATH="]


def assert_refused(api, resp, settings, *phrases: str) -> str:
    """422 problem naming the rule, nothing secret in it, and no job created."""
    assert resp.status_code == 422, resp.text
    assert resp.headers["Content-Type"].split(";")[0] == "application/problem+json"
    detail = resp.json()["detail"]
    for phrase in phrases:
        assert phrase in detail, detail
    for secret in secrets_of(settings):
        assert secret not in resp.text
    assert api.get("/v1/jobs").json() == {"jobs": []}
    return detail


def write_jsonl(path: Path, items) -> str:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def peak_rss_growth_mib(action) -> tuple[object, float]:
    """Runs action(); returns (its result, how far this process's RSS rose above its start, in MiB).

    Resets the kernel's peak (VmHWM) first where allowed, and samples VmRSS every millisecond too.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        hwm = True
    except OSError:
        hwm = False
    before = vm_kib("VmRSS")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], vm_kib("VmRSS"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = action()
    finally:
        done.set()
        sampler.join()
    top = max(peak[0], vm_kib("VmHWM") if hwm else 0)
    return result, (top - before) / 1024


# -- what may not be read --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["csv", "jsonl"])
@pytest.mark.parametrize("path,rule", [
    ("/proc/self/environ", "is in /proc, which sources may never read"),
    ("/etc/passwd", "is outside the source roots"),
    ("../../../../etc/hostname", "must be absolute"),
    ("/dev/zero", "is in /dev, which sources may never read"),
    ("/sys/kernel/uevent_seqnum", "is in /sys, which sources may never read"),
])
def test_server_files_are_refused_without_a_byte_of_them(api, settings, monkeypatch, path, rule, kind):
    monkeypatch.setenv("BATCHGATE_TEST_CANARY", CANARY)
    register(api)
    source = {"type": kind, "path": path} | ({"header": False} if kind == "csv" else {})
    assert_refused(api, start_job(api, source), settings, rule)


def test_relative_path_climbing_out_of_the_working_directory_is_refused(api, settings, tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)  # even resolved against a directory inside the root, it is refused
    register(api)
    assert_refused(api, start_job(api, {"type": "csv", "path": "../../../../etc/hostname",
                                        "header": False}), settings, "must be absolute")


def test_the_data_directory_is_refused_although_a_root_contains_it(api, settings):
    key = settings.signing_secret().decode()
    path = Path(settings.data_dir) / "signing-key"
    assert path.read_text().strip() == key and path.is_relative_to(settings.source_roots["*"][0])
    register(api)
    detail = assert_refused(api, start_job(api, {"type": "csv", "path": str(path), "header": False}),
                            settings, "data directory")
    assert key not in detail


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "data/signing-key"])
def test_a_symlink_inside_a_root_pointing_outside_is_refused(api, settings, tmp_path, target):
    settings.signing_secret()
    link = tmp_path / "innocent.csv"
    link.symlink_to(target if target.startswith("/") else tmp_path / target)
    register(api)
    detail = assert_refused(api, start_job(api, {"type": "csv", "path": str(link), "header": False}),
                            settings)
    assert any(rule in detail for rule in ("outside the source roots", "never read", "data directory"))


def test_a_symlinked_directory_inside_a_root_pointing_outside_is_refused(api, settings, tmp_path):
    (tmp_path / "etc").symlink_to("/etc")
    register(api)
    assert_refused(api, start_job(api, {"type": "csv", "path": str(tmp_path / "etc" / "passwd"),
                                        "header": False}), settings, "outside the source roots")


def test_a_fifo_inside_a_root_is_refused_without_blocking(api, settings, tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    register(api)
    started = time.monotonic()
    assert_refused(api, start_job(api, {"type": "jsonl", "path": str(fifo)}), settings,
                   "not a regular file")
    assert time.monotonic() - started < 5  # opening a FIFO for reading would wait for a writer


def test_a_directory_is_refused(api, settings, tmp_path):
    register(api)
    assert_refused(api, start_job(api, {"type": "jsonl", "path": str(tmp_path)}), settings,
                   "is a directory, not a regular file")


def test_system_directories_stay_refused_under_a_root_of_slash(serve_with, settings):
    api = serve_with(source_roots={"*": ["/"]})
    register(api)
    for path in ("/proc/self/environ", "/proc/1/environ", "/dev/zero", "/dev/stdin",
                 "/sys/kernel/uevent_seqnum", str(Path(settings.data_dir).resolve() / "signing-key")):
        assert_refused(api, start_job(api, {"type": "csv", "path": path, "header": False}), settings)


def test_file_sources_are_off_without_roots(serve_with, settings, tmp_path):
    api = serve_with(source_roots={})
    register(api)
    path = write_jsonl(tmp_path / "ok.jsonl", [1, 2, 3])
    assert_refused(api, start_job(api, {"type": "jsonl", "path": path}), settings,
                   "file sources are off: set BATCHGATE_SOURCE_ROOTS")
    resp = api.post("/v1/flows", json={"id": "dflt", "version": "1", "stages": [{"name": "s"}],
                                       "source": {"type": "jsonl", "path": path}})
    assert resp.status_code == 422 and "file sources are off" in resp.json()["detail"]


def test_a_file_inside_a_root_is_read_to_the_end(api, tmp_path):
    register(api)
    path = write_jsonl(tmp_path / "ok.jsonl", [{"n": i} for i in range(5)])
    resp = start_job(api, {"type": "jsonl", "path": path})
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["job_id"]
    seen = []
    while (lease := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        env = lease.json()
        seen += env["items"]
        done = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                        json={"lease_token": env["lease_token"], "output": {}})
        assert done.status_code == 200, done.text
    assert seen == [{"n": i} for i in range(5)]
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"


def test_tenants_read_only_their_own_roots_and_the_shared_ones(serve_with, settings, tmp_path):
    for name in ("acme", "globex", "shared"):
        (tmp_path / name).mkdir()
    acme = serve_with(source_roots={"acme": [str(tmp_path / "acme")], "globex": [str(tmp_path / "globex")],
                                    "*": [str(tmp_path / "shared")]})
    globex = acme.as_token(OTHER_TOKEN)
    acme_file = write_jsonl(tmp_path / "acme" / "a.jsonl", [{"secret": "acme-only"}])
    shared_file = write_jsonl(tmp_path / "shared" / "s.jsonl", [1])
    register(acme)
    register(globex)
    assert start_job(acme, {"type": "jsonl", "path": acme_file}).status_code == 201
    detail = assert_refused(globex, start_job(globex, {"type": "jsonl", "path": acme_file}), settings,
                            "outside the source roots")
    assert "acme-only" not in detail
    assert start_job(globex, {"type": "jsonl", "path": shared_file}).status_code == 201
    resp = globex.post("/v1/flows", json={"id": "steal", "version": "1", "stages": [{"name": "s"}],
                                          "source": {"type": "jsonl", "path": acme_file}})
    assert resp.status_code == 422 and "outside the source roots" in resp.json()["detail"]


def test_a_flow_default_path_is_checked_at_registration(api, settings, tmp_path):
    resp = api.post("/v1/flows", json={"id": "f", "version": "1", "stages": [{"name": "s"}],
                                       "source": {"type": "csv", "path": "/etc/passwd"}})
    assert resp.status_code == 422 and "outside the source roots" in resp.json()["detail"]
    later = tmp_path / "not-yet-written.jsonl"  # a path inside the roots may be written later
    register(api, "later", source={"type": "jsonl", "path": str(later)})


# -- every read checks again -----------------------------------------------------------------------

def lease_until_failed(api, job_id, tries=10) -> dict:
    for _ in range(tries):
        resp = api.post(f"/v1/jobs/{job_id}/lease")
        assert resp.status_code in (204, 409, 503), resp.text
        view = api.get(f"/v1/jobs/{job_id}").json()
        if view["status"] == "failed":
            return view
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not fail: {view}")


def test_a_file_swapped_for_a_symlink_after_creation_fails_the_job_at_lease(api, settings, tmp_path):
    register(api, retry={"maximum_attempts": 1})
    path = tmp_path / "swap.csv"
    path.write_text("a\n1\n2\n3\n")
    resp = start_job(api, {"type": "csv", "path": str(path), "header": False})
    assert resp.status_code == 201, resp.text
    path.unlink()
    path.symlink_to("/etc/passwd")
    view = lease_until_failed(api, resp.json()["job_id"])
    assert "outside the source roots" in (view["error"] or view["source_error"] or "")
    text = json.dumps(view) + api.get(f"/v1/jobs/{view['job_id']}/log").text
    assert "root:" not in text


def test_roots_narrowed_after_creation_apply_at_lease(serve_with, settings, tmp_path):
    wide = serve_with()
    register(wide, retry={"maximum_attempts": 1})
    path = write_jsonl(tmp_path / "ok.jsonl", [1, 2, 3])
    job_id = start_job(wide, {"type": "jsonl", "path": path}).json()["job_id"]
    narrow = serve_with(source_roots={"*": [str(tmp_path / "elsewhere")]})
    view = lease_until_failed(narrow, job_id)
    assert "outside the source roots" in (view["error"] or view["source_error"] or "")


# -- records are bounded ---------------------------------------------------------------------------

def test_a_2_mib_jsonl_line_in_the_first_batch_is_422_and_memory_stays_flat(api, settings, tmp_path):
    register(api)
    path = tmp_path / "long.jsonl"
    path.write_text('{"a": 1}\n' + json.dumps({"blob": "x" * (2 * MIB)}) + "\n")
    resp, grew = peak_rss_growth_mib(lambda: start_job(api, {"type": "jsonl", "path": str(path)}))
    detail = assert_refused(api, resp, settings, "line 2", "longer than max_record_bytes (1048576 bytes)")
    assert "xxxx" not in detail
    assert grew < 8, f"RSS rose {grew:.1f} MiB reading a 2 MiB line"


def test_a_2_mib_line_past_the_first_batch_fails_the_job_at_lease(api, tmp_path):
    register(api, max_items=2, retry={"maximum_attempts": 2, "initial_interval": 0.05})
    path = tmp_path / "late.jsonl"
    path.write_text('1\n2\n3\n' + json.dumps("y" * (2 * MIB)) + "\n5\n")
    resp = start_job(api, {"type": "jsonl", "path": str(path)})
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease").json()
    assert env["items"] == [1, 2]
    api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
             json={"lease_token": env["lease_token"], "output": {}})
    view = lease_until_failed(api, job_id, tries=40)  # retried under the first stage's policy, then failed
    error = view["error"] or view["source_error"] or ""
    assert "line 4" in error and "longer than max_record_bytes" in error and "yyyy" not in error


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_5_mib_source_without_newlines_is_422(api, settings, tmp_path, kind):
    register(api)
    path = tmp_path / f"flat.{kind}"
    path.write_bytes(b"z" * (5 * MIB))
    resp, grew = peak_rss_growth_mib(lambda: start_job(api, {"type": kind, "path": str(path)}))
    what = "record" if kind == "csv" else "line"
    detail = assert_refused(api, resp, settings, "line 1", f"{what} is longer than max_record_bytes")
    assert "zzzz" not in detail
    assert grew < 8, f"RSS rose {grew:.1f} MiB"


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_huge_stream_without_newlines_never_grows_the_process(api, settings, tmp_path, kind):
    """The /dev/zero attack inside a root: 1 GiB of NUL bytes (sparse) without a newline."""
    register(api)
    path = tmp_path / f"zeros.{kind}"
    with path.open("wb") as fh:
        fh.truncate(1024 * MIB)
    resp, grew = peak_rss_growth_mib(lambda: start_job(api, {"type": kind, "path": str(path)}))
    assert_refused(api, resp, settings, "longer than max_record_bytes")
    assert grew < 8, f"RSS rose {grew:.1f} MiB"


def test_a_csv_record_spanning_lines_is_bounded_as_a_whole(api, settings, tmp_path):
    register(api)
    path = tmp_path / "quoted.csv"
    path.write_text('id,text\n1,"' + ("short line\n" * 200_000) + '"\n')  # ~2.2 MiB in one record
    assert_refused(api, start_job(api, {"type": "csv", "path": str(path)}), settings,
                   "line 2", "record is longer than max_record_bytes")


def test_max_record_bytes_may_be_lowered_per_source_and_raised_up_to_the_cap(serve_with, settings, tmp_path):
    api = serve_with(max_record_bytes=4 * MIB)
    register(api)
    path = write_jsonl(tmp_path / "mid.jsonl", ["x" * 2000, "y" * (2 * MIB)])
    assert_refused(api, start_job(api, {"type": "jsonl", "path": path, "max_record_bytes": 1000}), settings,
                   "line 1", "longer than max_record_bytes (1000 bytes)")
    assert_refused(api, start_job(api, {"type": "jsonl", "path": path, "max_record_bytes": 5 * MIB}),
                   settings, "over the server's cap", "BATCHGATE_MAX_RECORD_BYTES")
    assert start_job(api, {"type": "jsonl", "path": path, "max_record_bytes": 3 * MIB}).status_code == 201


def test_records_up_to_the_limit_are_read_whole(api, tmp_path):
    register(api, max_items=1)
    path = tmp_path / "edge.csv"
    field = "q" * (MIB - 10)
    path.write_text(f"id,text\r\n1,{field}\r\n")  # CRLF is not counted, the record is just under 1 MiB
    resp = start_job(api, {"type": "csv", "path": str(path)})
    assert resp.status_code == 201, resp.text
    env = api.post(f"/v1/jobs/{resp.json()['job_id']}/lease").json()
    assert env["items"] == [{"id": "1", "text": field}]


# -- the reader itself -----------------------------------------------------------------------------

def test_a_url_stream_without_newlines_is_cut_at_max_record_bytes(tmp_path):
    body = b"w" * (64 * MIB)
    server = Server(lambda path, query, headers: (200, {}, body))
    try:
        source = chunker.open_source({"type": "jsonl", "url": server.url + "/flat.jsonl"})
        with pytest.raises(chunker.SourceReadError) as info:
            source.read_batch(source.initial_cursor(), max_items=10)
        assert info.value.retryable is False and "line 1" in str(info.value)
        # the reader stopped after about 1 MiB; socket buffers on both ends account for the rest sent
        assert server.finished_log()[0]["sent"] < 24 * MIB
    finally:
        server.close()


def test_a_url_stream_that_stalls_fails_retryably_after_the_read_timeout():
    """Headers and two lines, then nothing: the read fails (retryable) once no byte came for timeout_s."""
    release = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n1\n2\n")
            release.wait(10)

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/slow.jsonl"
        source = chunker.open_source({"type": "jsonl", "url": url}, timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(chunker.SourceReadError) as info:
            source.read_batch(source.initial_cursor(), max_items=10)
        assert info.value.retryable is True
        assert 0.4 < time.monotonic() - started < 5
    finally:
        release.set()
        thread.join()
        listener.close()


def test_open_file_refuses_a_final_component_swapped_for_a_symlink(tmp_path, monkeypatch):
    path = tmp_path / "f.jsonl"
    path.write_text("1\n")
    real_open = os.open

    def swapping_open(target, flags, *args):
        if str(target) == str(path):  # after the checks, before the open
            path.unlink()
            path.symlink_to("/etc/hostname")
        return real_open(target, flags, *args)

    monkeypatch.setattr(os, "open", swapping_open)
    with pytest.raises(FileAccessError, match="changed while it was opened"):
        open_file(str(path), FileAccess(roots=(str(tmp_path),)))


def test_open_file_refuses_a_directory_swapped_for_a_symlink(tmp_path, monkeypatch):
    inside, outside = tmp_path / "root", tmp_path / "outside"
    (inside / "d").mkdir(parents=True)
    (outside / "d").mkdir(parents=True)
    (inside / "d" / "f.jsonl").write_text("1\n")
    (outside / "d" / "f.jsonl").write_text("2\n")
    real_open = os.open

    def swapping_open(target, flags, *args):
        if str(target).endswith("f.jsonl"):
            (inside / "d" / "f.jsonl").unlink()
            (inside / "d").rmdir()
            (inside / "d").symlink_to(outside / "d")
        return real_open(target, flags, *args)

    monkeypatch.setattr(os, "open", swapping_open)
    with pytest.raises(FileAccessError, match="changed while it was opened"):
        open_file(str(inside / "d" / "f.jsonl"), FileAccess(roots=(str(inside),)))


def test_a_symlink_swapped_for_a_file_while_it_is_resolved_is_a_422_not_a_500(api, settings, tmp_path,
                                                                              monkeypatch):
    """realpath lstat()s a component, sees a symlink, then readlink() finds a file there (EINVAL)."""
    path = tmp_path / "swap.jsonl"
    path.symlink_to(write_jsonl(tmp_path / "real.jsonl", [1]))
    real_readlink = os.readlink

    def swapped(target, *args, **kwargs):
        if str(target) == str(path):
            raise OSError(errno.EINVAL, "Invalid argument", str(target))
        return real_readlink(target, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", swapped)
    resp = api.post("/v1/flows", json={"id": "swap", "version": "1", "stages": [{"name": "s"}],
                                       "source": {"type": "jsonl", "path": str(path)}})
    assert resp.status_code == 422, resp.text
    assert "changed while it was checked" in resp.json()["detail"]


SWAPPER = """
import os, sys
real, path, spare = sys.argv[1:4]
while True:
    try:
        os.unlink(spare)
    except FileNotFoundError:
        pass
    os.symlink(real, spare)
    os.replace(spare, path)  # now a symlink
    with open(spare, "w") as fh:
        fh.write("1\\n")
    os.replace(spare, path)  # now a file
"""


def test_checks_racing_a_path_swapped_between_file_and_symlink_only_ever_refuse(tmp_path):
    """The check flow registration and job creation run, against a real swapping process: every
    outcome is the resolved path or a FileAccessError (a 422), never another error (a 500). Without the
    fix about 1 in 3,000 checks raised OSError (EINVAL from readlink)."""
    real = write_jsonl(tmp_path / "real.jsonl", [1])
    path, spare = tmp_path / "swap.jsonl", tmp_path / "spare"
    path.write_text("1\n")
    access = FileAccess(roots=(str(tmp_path),))
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, real, str(path), str(spare)])
    outcomes: set[str] = set()
    try:
        time.sleep(0.05)
        deadline = time.monotonic() + 3  # about 20,000 checks on an idle machine
        for _ in range(20_000):
            if time.monotonic() > deadline:
                break
            try:
                check_path(str(path), access)
                outcomes.add("ok")
            except FileAccessError:
                outcomes.add("refused")
            except Exception as exc:  # noqa: BLE001
                outcomes.add(type(exc).__name__)
    finally:
        swapper.kill()
        swapper.wait()
    assert outcomes <= {"ok", "refused"}, outcomes


def test_the_library_default_reads_any_regular_file_but_never_system_ones(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [1])
    assert chunker.open_source({"type": "jsonl", "path": path}).read_batch(
        {"type": "offset", "offset": 0}, max_items=5).items == [1]
    for system in ("/proc/self/environ", "/dev/zero"):
        source = chunker.open_source({"type": "csv", "path": system, "header": False})
        with pytest.raises(FileAccessError, match="never read"):
            source.read_batch(source.initial_cursor(), max_items=5)


def test_max_record_bytes_is_validated_and_not_filled_in():
    assert "max_record_bytes" not in chunker.validate_spec({"type": "jsonl", "path": "/a"})
    spec = chunker.validate_spec({"type": "csv", "path": "/a", "max_record_bytes": 10})
    assert spec["max_record_bytes"] == 10
    for bad in (0, "1", 1.5, True):
        with pytest.raises(chunker.SourceSpecError, match="max_record_bytes"):
            chunker.validate_spec({"type": "jsonl", "path": "/a", "max_record_bytes": bad})


def test_a_root_is_a_directory_not_a_string_prefix(tmp_path):
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme2").mkdir()
    sibling = write_jsonl(tmp_path / "acme2" / "x.jsonl", [1])
    with pytest.raises(FileAccessError, match="outside the source roots"):
        open_file(sibling, FileAccess(roots=(str(tmp_path / "acme"),)))
    with pytest.raises(FileAccessError, match="outside the source roots"):
        open_file(str(tmp_path / "acme" / ".." / "acme2" / "x.jsonl"),
                  FileAccess(roots=(str(tmp_path / "acme"),)))
