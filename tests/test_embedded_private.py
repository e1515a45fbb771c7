"""The embedded Redis is private to the user running batchgate: no TCP port, a unix socket in a 0700
directory, CONFIG/DEBUG/MODULE disabled, data folder 0700 and its files 0600."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import redis

from gateway.ledger.embedded import EmbeddedRedis, client_for, socket_dir


@pytest.fixture
def server(tmp_path):
    srv = EmbeddedRedis(tmp_path / "data")
    srv.start()
    client = client_for(srv.url)
    client.set("secret", "tenant data")
    client.execute_command("BGREWRITEAOF")
    yield srv, client
    client.close()
    srv.stop()


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_it_listens_on_no_tcp_port_and_refuses_dangerous_commands(server):
    srv, client = server
    assert srv.url.startswith("unix://")
    assert client.info("server")["tcp_port"] == 0
    for command in (("CONFIG", "GET", "dir"), ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)


def test_data_folder_socket_folder_and_files_are_private(server, tmp_path):
    srv, client = server
    assert _mode(srv.data_dir) == 0o700
    assert _mode(socket_dir(srv.data_dir)) == 0o700
    files = [p for p in srv.data_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"redis.json", "redis.log"}
    assert any("appendonly" in p.name for p in files)
    for path in files:
        assert _mode(path) & 0o077 == 0, f"{path} is {oct(_mode(path))}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another local user")
def test_another_local_user_cannot_connect(server):
    """A forked child drops to user nobody and tries the socket: refused before Redis is reached."""
    srv, _ = server
    path = srv.url.removeprefix("unix://").split("?")[0]
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery, only os and socket
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(path)
            sock.sendall(b"GET secret\r\n")
            code = 0 if b"tenant data" in sock.recv(100) else 4
        except PermissionError:
            code = 3
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


def test_a_directory_someone_else_prepared_is_refused(tmp_path, monkeypatch):
    """The socket folder's name is predictable; one that exists with loose modes is tightened, and a
    symlink planted in its place is refused rather than followed."""
    data = tmp_path / "data2"
    target = tmp_path / "elsewhere"
    target.mkdir()
    planted = socket_dir(data)
    if planted.exists() or planted.is_symlink():
        planted.unlink() if planted.is_symlink() else os.rmdir(planted)
    planted.symlink_to(target)
    try:
        with pytest.raises(RuntimeError, match="not a directory owned by this user"):
            EmbeddedRedis(data).start()
    finally:
        planted.unlink()
