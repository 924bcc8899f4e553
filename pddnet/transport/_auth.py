"""Run the data-plane authentication handshake over a fresh TCP connection.

The handshake itself is sans-IO (:class:`pddnet.wire.AuthHandshake`); this
driver pumps it over a non-blocking socket with trio, reading exactly what
the machine asks for, so no byte past the handshake is consumed.
"""

from __future__ import annotations

import contextlib
import socket

import trio

from .._errors import AuthError, PeerUnavailable
from ..wire._auth import AuthHandshake, AuthRole, AuthState, auth_context

__all__ = ["authenticate"]

K_AUTH_TIMEOUT_S = 5.0


async def authenticate(
    sock: socket.socket,
    secret: bytes,
    role: AuthRole,
    *,
    channel: str = "wan",
    timeout: float = K_AUTH_TIMEOUT_S,
) -> None:
    """Prove, and check, knowledge of ``secret`` on ``sock`` before any data.

    Args:
        sock: a connected, non-blocking TCP socket.
        secret: the shared secret.
        role: ``INITIATOR`` on the connecting side, ``RESPONDER`` on the accepting one.
        channel: binds the proof to one data path (``wan`` or ``local``).
        timeout: seconds the peer has to finish.

    Raises:
        AuthError: if the peer fails, rejects or does not finish in time; the
            caller must close the socket.
        PeerUnavailable: if the connection breaks.
    """
    hs = AuthHandshake(
        role,
        secret,
        auth_context(channel, "sender", "receiver"),
        now=trio.current_time(),
        timeout=timeout,
    )
    try:
        while True:
            out = hs.data_to_send()
            while out:
                await trio.lowlevel.wait_writable(sock)
                out = out[sock.send(out) :]
            if hs.state is AuthState.DONE:
                return
            if hs.state is AuthState.FAILED:
                assert hs.error is not None
                raise hs.error
            deadline = hs.get_timer()
            with trio.move_on_at(deadline if deadline is not None else trio.current_time()):
                await trio.lowlevel.wait_readable(sock)
                data = sock.recv(hs.bytes_wanted())
                if not data:
                    raise PeerUnavailable("connection closed during authentication")
                # on AuthError the state is FAILED: the loop sends our FAIL frame and raises
                with contextlib.suppress(AuthError):
                    hs.receive_data(data)
                continue
            hs.handle_timer(trio.current_time())
    except OSError as exc:
        raise PeerUnavailable(f"connection failed during authentication: {exc}") from exc
