"""TCP tuning of the control plane's zmq connections, checked on the kernel sockets.

The node learns each connection's descriptor from a zmq socket monitor; these
tests find the connections independently (every TCP socket of this process
that touches the server's port) and read the options back with getsockopt.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator

import pytest
import trio

from pddnet import LocalProtocolError
from pddnet.control import ControlNode, TcpTuning, _tcp
from pddnet.control._tcp import K_TCP_DELACK_MAX_US, K_TCP_RTO_MIN_US, endpoint_port, tune_fd
from pddnet.wire import Ping

KEY = "an-honest-shared-secret-0123456789"
TUNING = TcpTuning(rto_min_s=0.01, delack_max_s=0.02)


def _kernel_value(opt: int, us: int) -> int | None:
    """What the kernel reads back after setting ``opt`` to ``us`` (None: unsupported)."""
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, opt, us)
        except OSError:
            return None
        return s.getsockopt(socket.IPPROTO_TCP, opt)


def _default(opt: int) -> int:
    with socket.socket() as s:
        return s.getsockopt(socket.IPPROTO_TCP, opt)


needs_kernel = pytest.mark.skipif(
    _kernel_value(K_TCP_RTO_MIN_US, 10_000) is None
    or _kernel_value(K_TCP_DELACK_MAX_US, 20_000) is None,
    reason="kernel lacks TCP_RTO_MIN_US / TCP_DELACK_MAX_US (Linux < 6.15)",
)


def _connections(port: int) -> Iterator[tuple[str, int, int]]:
    """(side, rto_min_us, delack_max_us) of this process's TCP connections on ``port``."""
    for name in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(name))
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family != socket.AF_INET:
                continue
            try:
                local, peer = sock.getsockname(), sock.getpeername()
            except OSError:
                continue  # a listener
            if port not in (local[1], peer[1]):
                continue
            yield (
                "accepted" if local[1] == port else "connected",
                sock.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US),
                sock.getsockopt(socket.IPPROTO_TCP, K_TCP_DELACK_MAX_US),
            )


def test_tuning_values_and_endpoints() -> None:
    assert TcpTuning().options() == []
    assert TcpTuning.wan().options() == [
        ("TCP_RTO_MIN_US", K_TCP_RTO_MIN_US, 5000),
        ("TCP_DELACK_MAX_US", K_TCP_DELACK_MAX_US, 5000),
    ]
    for bad in (0.0, -1.0, 0.5):
        with pytest.raises(LocalProtocolError):
            TcpTuning(rto_min_s=bad)
        with pytest.raises(LocalProtocolError):
            TcpTuning(delack_max_s=bad)
    assert endpoint_port(b"tcp://127.0.0.1:5555") == 5555
    assert endpoint_port(b"tcp://[::1]:80") == 80
    for endpoint in (b"ipc:///tmp/x", b"tcp://host", b"tcp://host:port", b"inproc://a:1"):
        assert endpoint_port(endpoint) is None


def test_tune_fd_checks_the_descriptor_is_the_named_connection() -> None:
    with socket.socket() as lst, socket.socket() as cli:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        cli.connect(("127.0.0.1", port))
        srv, _ = lst.accept()
        with srv:
            opts = [("X", K_TCP_DELACK_MAX_US, 20_000)]
            before = cli.getsockopt(socket.IPPROTO_TCP, K_TCP_DELACK_MAX_US)
            # a descriptor that is not the connection the event named: left alone
            assert tune_fd(cli.fileno(), f"tcp://127.0.0.1:{port + 1}".encode(), False, opts) == (
                [],
                [],
            )
            assert tune_fd(cli.fileno(), b"ipc:///x", False, opts) == ([], [])
            assert cli.getsockopt(socket.IPPROTO_TCP, K_TCP_DELACK_MAX_US) == before
            r, w = os.pipe()  # not a socket at all
            try:
                assert tune_fd(r, f"tcp://127.0.0.1:{port}".encode(), False, opts) == ([], [])
            finally:
                os.close(r)
                os.close(w)
            # an option the kernel does not know is reported, not raised
            unknown = [("NOPE", 9999, 1)]
            assert tune_fd(cli.fileno(), f"tcp://127.0.0.1:{port}".encode(), False, unknown) == (
                [],
                ["NOPE"],
            )
            # the right connection, named from either side, is tuned
            assert tune_fd(cli.fileno(), f"tcp://127.0.0.1:{port}".encode(), False, opts) == (
                ["X"],
                [],
            )
            assert tune_fd(srv.fileno(), f"tcp://0.0.0.0:{port}".encode(), True, opts) == (
                ["X"],
                [],
            )
            tuned = _kernel_value(K_TCP_DELACK_MAX_US, 20_000)
            if tuned is not None:
                for s in (cli, srv):
                    assert s.getsockopt(socket.IPPROTO_TCP, K_TCP_DELACK_MAX_US) == tuned


@needs_kernel
async def test_every_connection_made_or_accepted_is_tuned() -> None:
    rto = _kernel_value(K_TCP_RTO_MIN_US, 10_000)
    delack = _kernel_value(K_TCP_DELACK_MAX_US, 20_000)
    assert rto is not None and delack is not None
    defaults = (_default(K_TCP_RTO_MIN_US), _default(K_TCP_DELACK_MAX_US))
    assert (rto, delack) != defaults  # the check below can tell tuned from untuned
    async with (
        ControlNode("b", secret=KEY, tcp=TUNING) as b,
        ControlNode("a", secret=KEY, tcp=TUNING) as a,
        ControlNode("c", secret=KEY) as c,  # untuned
    ):
        port = int(b.address.rsplit(":", 1)[1])
        await a.connect("b", b.address, paths=2)
        await c.connect("b", b.address)
        for node in (a, c):
            assert await node.request("b", Ping(b"x"), timeout=5) is not None
        with trio.fail_after(10):
            while a.statistics().tcp_tuned < 2 or b.statistics().tcp_tuned < 3:
                await a.request("b", Ping(), timeout=5)  # also brings the twin up
                await trio.sleep(0.01)
        conns = sorted(_connections(port))
        # b accepted three connections (a's two, c's one), all tuned; a's two are
        # tuned on a's side; c's is not
        assert conns.count(("accepted", rto, delack)) == 3
        assert conns.count(("connected", rto, delack)) == 2
        assert conns.count(("connected", *defaults)) == 1
        assert len(conns) == 6
        assert c.statistics().tcp_tuned == 0


@needs_kernel
async def test_a_missing_kernel_option_is_logged_once_and_the_rest_applies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_tcp, "K_TCP_RTO_MIN_US", 9999)  # an option no kernel has
    delack = _kernel_value(K_TCP_DELACK_MAX_US, 20_000)
    assert delack is not None
    caplog.set_level(logging.WARNING, logger="pddnet.control")
    async with (
        ControlNode("b", secret=KEY, tcp=TUNING) as b,
        ControlNode("a", secret=KEY, tcp=TUNING) as a,
    ):
        port = int(b.address.rsplit(":", 1)[1])
        await a.connect("b", b.address, paths=3)
        with trio.fail_after(10):
            # the first connection on each side learns the option is missing
            while a.statistics().tcp_tuned < 2 or b.statistics().tcp_tuned < 2:
                await a.request("b", Ping(), timeout=5)
                await trio.sleep(0.01)
        sides = [(side, d) for side, _, d in _connections(port)]
        assert sides.count(("connected", delack)) == 3  # every one: delack was still set
        assert sides.count(("accepted", delack)) == 3
    warnings = [r.getMessage() for r in caplog.records if "TCP_RTO_MIN_US" in r.getMessage()]
    assert len(warnings) == 2  # once per node
