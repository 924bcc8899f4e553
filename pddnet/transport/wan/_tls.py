"""Optional TLS on the WAN data connections (stdlib :mod:`ssl` on the raw sockets).

Why stdlib ``ssl.SSLSocket`` and not ``trio.SSLStream``: the WAN hot loops use
non-blocking stdlib sockets (see :mod:`._io`); an ``SSLSocket`` keeps that
shape, and ``SSLSocket.recv_into`` decrypts straight from OpenSSL's record
buffer into the destination memory (one copy, as the kernel's own copy is on
plain TCP). ``trio.SSLStream`` goes through memory BIOs: the ciphertext is
copied into a ``bytes`` object, into the BIO, decrypted into another
``bytes`` object and copied once more into the destination, and every call
yields to the scheduler (docs/wan.md, "TLS", has the measurement).

TLS does not replace the challenge-response of :mod:`pddnet.transport._auth`:
it still runs, *inside* the TLS channel, and its context carries the TLS
channel binding (``tls-unique``: the first Finished message of the handshake),
so a proof made on one TLS session does not verify on another. A peer must
hold a certificate the other side trusts *and* the shared secret.

The handshake is bounded by :attr:`TlsConfig.handshake_timeout` (a peer that
opens a connection and stays silent is dropped) and every failure is a typed
:class:`~pddnet.AuthError` (certificate, protocol, plaintext peer, timeout) or
:class:`~pddnet.PeerUnavailable` (the connection broke).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import trio

from ..._errors import AuthError, LocalProtocolError, PeerUnavailable

__all__ = ["TlsConfig", "channel_binding", "tls_handshake"]

K_TLS_HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS settings of one end of the WAN data path.

    Args:
        cert: PEM certificate (chain) of this end: required on the receiver, and
            on the sender for mutual TLS.
        key: PEM private key of ``cert`` (None: the key is in the ``cert`` file).
        ca: PEM CA bundle that verifies the *peer*'s certificate. On the sender,
            None means the system's default trust store. On the receiver it is
            required when ``require_client_cert`` is set.
        server_hostname: (sender) the name the receiver's certificate must carry
            (None: the host part of the receiver address; an IP address matches
            an IP subjectAltName).
        check_hostname: (sender) verify the receiver's name; turning it off still
            verifies the certificate chain against ``ca``.
        require_client_cert: (receiver) mutual TLS: a sender without a
            certificate signed by ``ca`` is refused.
        handshake_timeout: seconds a peer has to finish the TLS handshake.
        min_version: the oldest protocol accepted (default TLS 1.2).
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_hostname: str | None = None
    check_hostname: bool = True
    require_client_cert: bool = False
    handshake_timeout: float = K_TLS_HANDSHAKE_TIMEOUT_S
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2

    def server_context(self) -> ssl.SSLContext:
        """An ``SSLContext`` for the receiver.

        Raises:
            LocalProtocolError: if the configuration is incomplete or a file is unreadable.
        """
        if self.cert is None:
            raise LocalProtocolError("a TLS receiver needs a certificate (TlsConfig.cert)")
        if self.require_client_cert and self.ca is None:
            raise LocalProtocolError("mutual TLS needs a CA to verify senders (TlsConfig.ca)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._common(ctx)
        if self.require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """An ``SSLContext`` for the sender.

        Raises:
            LocalProtocolError: if a file is unreadable.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = self.check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
        if self.ca is None:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
        self._common(ctx)
        return ctx

    def _common(self, ctx: ssl.SSLContext) -> None:
        ctx.minimum_version = self.min_version
        # a write never has to wait for a read (see _io._send_all_tls)
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        try:
            if self.cert is not None:
                ctx.load_cert_chain(self.cert, self.key)
            if self.ca is not None:
                ctx.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise LocalProtocolError(f"TLS configuration: {exc}") from exc


def channel_binding(sock: Any) -> bytes:
    """The ``tls-unique`` binding of an established TLS socket (b"" for plain TCP)."""
    if isinstance(sock, ssl.SSLSocket):
        return sock.get_channel_binding("tls-unique") or b""
    return b""


async def tls_handshake(
    sock: Any,
    ctx: ssl.SSLContext,
    *,
    server_side: bool,
    server_hostname: str | None = None,
    timeout: float = K_TLS_HANDSHAKE_TIMEOUT_S,
) -> ssl.SSLSocket:
    """Wrap a connected non-blocking TCP socket in TLS and run the handshake.

    Args:
        sock: the connected, non-blocking socket. It is *detached* by the wrap:
            from here on only the returned socket owns the file descriptor
            (closing it on error is the caller's job either way: the returned
            socket on success, ``sock`` never again).
        ctx: from :meth:`TlsConfig.server_context` / :meth:`TlsConfig.client_context`.
        server_side: True on the receiver.
        server_hostname: (client) the name to verify.
        timeout: seconds for the whole handshake.

    Returns:
        The TLS socket, still non-blocking.

    Raises:
        AuthError: on a certificate, protocol or timeout failure (the socket is closed).
        PeerUnavailable: if the connection broke (the socket is closed).
    """
    tls = ctx.wrap_socket(
        sock,
        server_side=server_side,
        do_handshake_on_connect=False,
        server_hostname=None if server_side else server_hostname,
    )
    try:
        with trio.fail_after(timeout):
            while True:
                try:
                    tls.do_handshake()
                    return tls
                except ssl.SSLWantReadError:
                    await trio.lowlevel.wait_readable(tls)
                except ssl.SSLWantWriteError:
                    await trio.lowlevel.wait_writable(tls)
    except trio.TooSlowError:
        _close(tls)
        raise AuthError(f"TLS handshake did not finish in {timeout:.1f} s") from None
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError) as exc:
        # closed or reset mid-handshake, e.g. by a receiver's connection bound: retry
        _close(tls)
        raise PeerUnavailable(f"connection closed during the TLS handshake: {exc}") from exc
    except ssl.SSLCertVerificationError as exc:
        _close(tls)
        why = f"certificate verify failed: {exc.verify_message}"
        raise AuthError(f"TLS handshake failed: {why}") from exc
    except ssl.SSLError as exc:
        _close(tls)
        raise AuthError(f"TLS handshake failed: {exc.reason or exc}") from exc
    except OSError as exc:
        _close(tls)
        raise PeerUnavailable(f"connection failed during the TLS handshake: {exc}") from exc
    except BaseException:
        _close(tls)
        raise


def _close(sock: Any) -> None:
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()
