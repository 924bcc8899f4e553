"""Run the data-plane authentication handshake over a fresh TCP connection.

The handshake itself is sans-IO (:class:`pddnet.wire.AuthHandshake`); this
driver pumps it over a non-blocking socket with trio, reading exactly what
the machine asks for, so no byte past the handshake is consumed.

Over TLS (an ``ssl.SSLSocket`` whose handshake is done) the exchange runs
inside the TLS channel and its context carries the channel binding
(``tls-unique``), so a proof relayed from another TLS session does not verify.
"""

from __future__ import annotations

import contextlib
import socket
import ssl

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
    if isinstance(sock, ssl.SSLSocket):
        binding = sock.get_channel_binding("tls-unique") or b""
        channel = f"{channel}+tls:{binding.hex()}"
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
                out = out[await _send_some(sock, out) :]
            if hs.state is AuthState.DONE:
                return
            if hs.state is AuthState.FAILED:
                assert hs.error is not None
                raise hs.error
            deadline = hs.get_timer()
            with trio.move_on_at(deadline if deadline is not None else trio.current_time()):
                data = await _recv_some(sock, hs.bytes_wanted())
                if not data:
                    raise PeerUnavailable("connection closed during authentication")
                # on AuthError the state is FAILED: the loop sends our FAIL frame and raises
                with contextlib.suppress(AuthError):
                    hs.receive_data(data)
                continue
            hs.handle_timer(trio.current_time())
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError) as exc:
        raise PeerUnavailable(f"connection closed during authentication: {exc}") from exc
    except ssl.SSLError as exc:
        raise AuthError(f"TLS failed during authentication: {exc.reason or exc}") from exc
    except OSError as exc:
        raise PeerUnavailable(f"connection failed during authentication: {exc}") from exc


async def _send_some(sock: socket.socket, data: bytes) -> int:
    while True:
        await trio.lowlevel.wait_writable(sock)
        try:
            return sock.send(data)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            continue


async def _recv_some(sock: socket.socket, n: int) -> bytes:
    tls = isinstance(sock, ssl.SSLSocket)
    while True:
        # OpenSSL may hold decrypted bytes the kernel no longer shows as readable
        if not (tls and sock.pending()):  # type: ignore[attr-defined]
            await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(n)
        except ssl.SSLZeroReturnError:
            return b""
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            # e.g. a TLS 1.3 session ticket: no application data yet
            await trio.lowlevel.checkpoint()
