"""The data-plane handshake driver over real sockets."""

from __future__ import annotations

import socket

import pytest
import trio

from pddnet import AuthError
from pddnet.transport._auth import authenticate
from pddnet.wire._auth import AuthRole

SECRET = b"data-plane-secret-0123456789abcdef"


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def test_same_secret_authenticates_and_leaves_data_unread() -> None:
    a, b = pair()
    with a, b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(authenticate, a, SECRET, AuthRole.INITIATOR)
            await authenticate(b, SECRET, AuthRole.RESPONDER)
        a.send(b"chunk")  # the first data byte after the handshake is still ours
        await trio.lowlevel.wait_readable(b)
        assert b.recv(100) == b"chunk"


async def test_wrong_secret_fails_on_both_ends() -> None:
    a, b = pair()
    errors: list[BaseException] = []

    async def run(sock: socket.socket, secret: bytes, role: AuthRole) -> None:
        try:
            await authenticate(sock, secret, role)
        except AuthError as exc:
            errors.append(exc)

    with a, b, trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, a, SECRET, AuthRole.INITIATOR)
            nursery.start_soon(run, b, b"another-secret-0123456789", AuthRole.RESPONDER)
    assert len(errors) == 2


async def test_silent_peer_times_out() -> None:
    a, b = pair()
    with a, b, trio.fail_after(5), pytest.raises(AuthError, match="timed out"):
        await authenticate(b, SECRET, AuthRole.RESPONDER, timeout=0.2)


async def test_garbage_is_rejected_without_reading_past_a_frame() -> None:
    a, b = pair()
    with a, b, trio.fail_after(5):
        a.send(b"GET / HTTP/1.1\r\n" * 10)
        with pytest.raises(AuthError):
            await authenticate(b, SECRET, AuthRole.RESPONDER)


async def test_wan_streams_authenticate_before_any_chunk() -> None:
    import os

    from pddnet import PddnetError
    from pddnet.kv import ByteRanges
    from pddnet.transport.wan import WanReceiver, WanSender

    n = 1 << 20
    ranges = ByteRanges.build([0], [0], [n], [0])
    src = bytearray(os.urandom(n))
    async with WanReceiver(secret=SECRET) as rx:
        dst = bytearray(n)
        async with WanSender(rx.address, secret=SECRET, streams=2) as tx:
            grant = rx.grant([dst], ranges, timeout=10)
            with trio.fail_after(10):
                await tx.send(grant, [src], ranges, timeout=10)
                await rx.wait_transfer(grant.transfer_id)
        assert dst == src and rx.auth_failures == 0
        # a sender with another secret never gets a chunk in
        dst2 = bytearray(n)
        grant2 = rx.grant([dst2], ranges, timeout=10)
        async with WanSender(
            rx.address, secret=b"not-the-secret-0123456789", streams=2, peer_timeout=1.0
        ) as bad:
            with trio.fail_after(10), pytest.raises(PddnetError):
                await bad.send(grant2, [src], ranges, timeout=3)
        assert rx.auth_failures >= 1 and bad.auth_failures >= 1
        assert dst2 == bytearray(n)  # untouched
