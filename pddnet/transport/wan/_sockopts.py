"""Socket tuning and ``TCP_INFO`` reading for the WAN streams (Linux)."""

from __future__ import annotations

import logging
import socket
import struct
from typing import Any

from ._pacer import TcpSample

__all__ = [
    "K_SO_MAX_PACING_RATE",
    "read_tcp_info",
    "set_notsent_lowat",
    "set_pacing_rate",
    "tune_socket",
]

log = logging.getLogger(__name__)

# <asm-generic/socket.h>
K_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
K_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
K_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
K_TCP_INFO = getattr(socket, "TCP_INFO", 11)

# struct tcp_info (<linux/tcp.h>), the fields we read, by offset:
# rtt u32 @68 (us), snd_cwnd u32 @80, pacing_rate u64 @104, min_rtt u32 @148 (us),
# delivery_rate u64 @160 (bytes/s), bytes_sent u64 @200, bytes_retrans u64 @208,
# snd_wnd u32 @228 (Linux 5.4+).
_TCP_INFO_LEN = 232
# The TCP_INFO fields a TcpSample reads, in one unpack (a sample loop reads 9
# streams up to 100 times a second): rtt @68, snd_cwnd @80, pacing_rate @104,
# min_rtt @148, delivery_rate @160, bytes_sent @200, bytes_retrans @208, and
# snd_wnd @228 where the kernel reports it (232 bytes, else 216).
_INFO_216 = struct.Struct("<68xI8xI20xQ36xI8xQ32xQQ")
_INFO_232 = struct.Struct("<68xI8xI20xQ36xI8xQ32xQQ12xI")


def available_congestion() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def tune_socket(
    sock: Any,
    *,
    buffer_bytes: int,
    congestion: str | None,
    notsent_lowat: int | None,
    sender: bool,
) -> str:
    """Set buffers, congestion control, NODELAY and the unsent low-water mark.

    Buffers use ``SO_SNDBUFFORCE``/``SO_RCVBUFFORCE`` when permitted (root), so a
    small ``net.core.wmem_max`` does not cap a long fat pipe; else the plain
    options (which the kernel clamps). Returns the congestion control in use.
    """
    for force, plain in (
        (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF),
        (getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF),
    ):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, plain, buffer_bytes)
    # Headers and acks are small writes that must not wait for Nagle.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sender and notsent_lowat:
        # Writable only when little is unsent: keeps the queue in the socket short, so
        # a high-priority chunk is not stuck behind megabytes of bulk in a send buffer.
        set_notsent_lowat(sock, notsent_lowat)
    if congestion:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, K_TCP_CONGESTION, congestion.encode())
        except OSError as exc:
            log.warning(
                "congestion control %r unavailable (%s); using the default", congestion, exc
            )
    try:
        cc = sock.getsockopt(socket.IPPROTO_TCP, K_TCP_CONGESTION, 16)
        return bytes(cc).split(b"\0", 1)[0].decode()
    except OSError:
        return ""


def set_notsent_lowat(sock: Any, lowat: int) -> None:
    """``TCP_NOTSENT_LOWAT``: writable only while fewer unsent bytes are queued."""
    sock.setsockopt(socket.IPPROTO_TCP, K_TCP_NOTSENT_LOWAT, lowat)


def set_pacing_rate(sock: Any, rate: float | None) -> None:
    """Set ``SO_MAX_PACING_RATE`` in bytes/s (None = unlimited)."""
    value = 0xFFFFFFFFFFFFFFFF if rate is None else max(int(rate), 1)
    try:
        sock.setsockopt(socket.SOL_SOCKET, K_SO_MAX_PACING_RATE, struct.pack("<Q", value))
    except OSError:
        value32 = 0xFFFFFFFF if rate is None else min(max(int(rate), 1), 0xFFFFFFFE)
        sock.setsockopt(socket.SOL_SOCKET, K_SO_MAX_PACING_RATE, value32)


def read_tcp_info(sock: Any, stream: int) -> TcpSample | None:
    """One :class:`TcpSample` from ``TCP_INFO``, or None if unavailable."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, K_TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(raw) >= 232:
        rtt, cwnd, pacing, min_rtt, delivery, sent, retrans, snd_wnd = _INFO_232.unpack_from(raw)
    elif len(raw) >= 216:
        rtt, cwnd, pacing, min_rtt, delivery, sent, retrans = _INFO_216.unpack_from(raw)
        snd_wnd = 0
    else:
        return None
    return TcpSample(
        stream,
        rtt / 1e6,
        min_rtt / 1e6,
        float(delivery),
        sent,
        retrans,
        cwnd,
        float(pacing),
        snd_wnd,
    )
