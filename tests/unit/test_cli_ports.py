"""`dtq dev` / `dtq api` check their ports the way the servers bind them (SO_REUSEADDR)."""

from __future__ import annotations

import socket

from dtq_cli.run_cmd import _port_free


def _time_wait_port() -> int:
    """A port whose last server closed its side of a connection first: that side is left in
    TIME_WAIT, as after `curl` against a stopped `dtq dev`."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server closes first
        client.recv(1)  # sees the FIN
        client.close()
    return port


def test_a_port_in_time_wait_is_free_for_a_new_server() -> None:
    port = _time_wait_port()
    with socket.socket() as plain:
        try:
            plain.bind(("127.0.0.1", port))
            plain_ok = True
        except OSError:
            plain_ok = False
    assert not plain_ok, "setup: a bind without SO_REUSEADDR should fail in TIME_WAIT"
    assert _port_free(port)


def test_a_listening_port_is_busy() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert not _port_free(int(listener.getsockname()[1]))
