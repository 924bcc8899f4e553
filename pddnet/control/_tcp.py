"""Per-connection TCP settings for the control plane's zmq connections.

zmq owns its TCP sockets and exposes no ``setsockopt`` for them, but a zmq
socket monitor reports the file descriptor of each connection it makes
(``EVENT_CONNECTED``) or accepts (``EVENT_ACCEPTED``). The node duplicates
that descriptor, checks that it still is the TCP connection the event named
(a descriptor closed meanwhile may have been reused), and sets the options on
the shared kernel socket.

The options that matter across a WAN are the minimum retransmission timeout
and the longest delayed ACK (Linux 6.15+: ``TCP_RTO_MIN_US``,
``TCP_DELACK_MAX_US``). With one segment in flight, Linux probes for a lost
tail after ``2 * SRTT + rto_min``: with the default 200 ms rto_min, a lost
one-packet control message costs about 260 ms on a 30 ms link. A lower
rto_min is safe only if the peer does not delay its ACKs as long, hence the
pair.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

from .._errors import LocalProtocolError

__all__ = ["K_TCP_DELACK_MAX_US", "K_TCP_RTO_MIN_US", "TcpTuning", "endpoint_port", "tune_fd"]

K_TCP_RTO_MIN_US = 45  # include/uapi/linux/tcp.h, Linux 6.15
K_TCP_DELACK_MAX_US = 46
_MAX_S = 0.2  # the kernel accepts up to its defaults (TCP_RTO_MIN, TCP_DELACK_MAX: 200 ms)
# errnos meaning "this kernel lacks the option" (EINVAL: or refuses the value, e.g. below
# two jiffies)
_UNSUPPORTED = (errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EINVAL)


@dataclass(frozen=True, slots=True)
class TcpTuning:
    """TCP options set on every control-plane connection of a node.

    Args:
        rto_min_s: minimum retransmission timeout (``TCP_RTO_MIN_US``); the
            kernel rounds it up to whole jiffies (4 ms at HZ=250). None
            leaves the system default (200 ms).
        delack_max_s: longest delayed ACK (``TCP_DELACK_MAX_US``); None leaves
            the default (200 ms).

    Raises:
        LocalProtocolError: if a value is not in (0, 0.2] seconds.
    """

    rto_min_s: float | None = None
    delack_max_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("rto_min_s", "delack_max_s"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= _MAX_S:
                raise LocalProtocolError(f"TcpTuning.{name} must be in (0, {_MAX_S}] s, not {v}")

    @classmethod
    def wan(cls) -> TcpTuning:
        """The profile for control connections across a WAN: both timers at 5 ms."""
        return cls(rto_min_s=0.005, delack_max_s=0.005)

    def options(self) -> list[tuple[str, int, int]]:
        """``(name, TCP option number, value in microseconds)`` for each set option."""
        out = []
        if self.rto_min_s is not None:
            out.append(("TCP_RTO_MIN_US", K_TCP_RTO_MIN_US, round(self.rto_min_s * 1e6)))
        if self.delack_max_s is not None:
            out.append(("TCP_DELACK_MAX_US", K_TCP_DELACK_MAX_US, round(self.delack_max_s * 1e6)))
        return out


def endpoint_port(endpoint: bytes) -> int | None:
    """The port of a zmq ``tcp://host:port`` endpoint; None for anything else."""
    text = endpoint.decode(errors="replace")
    if not text.startswith("tcp://"):
        return None
    _, _, port = text.rpartition(":")
    return int(port) if port.isdecimal() else None


def tune_fd(
    fd: int, endpoint: bytes, accepted: bool, options: list[tuple[str, int, int]]
) -> tuple[list[str], list[str]]:
    """Set ``options`` on the TCP connection behind ``fd`` if it is the one ``endpoint`` names.

    The descriptor is duplicated, never taken over: zmq keeps owning it.

    Args:
        fd: the descriptor a monitor event reported.
        endpoint: the event's endpoint (ours for an accepted connection, the
            peer's for one we made).
        accepted: whether the event was ``EVENT_ACCEPTED``.
        options: from :meth:`TcpTuning.options`.

    Returns:
        (names of the options set, names the kernel does not support or whose
        value it refused). Both
        are empty when ``fd`` no longer is that connection.

    Raises:
        OSError: for any other failure of ``setsockopt``.
    """
    want = endpoint_port(endpoint)
    try:
        dup = os.dup(fd)
    except OSError:
        return [], []  # closed meanwhile
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket any more
        os.close(dup)
        return [], []
    with sock:
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                return [], []
            addr = sock.getsockname() if accepted else sock.getpeername()
        except OSError:
            return [], []  # not connected any more
        if want is None or addr[1] != want:
            return [], []  # the descriptor was reused for something else
        done, unsupported = [], []
        for name, opt, value in options:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                unsupported.append(name)
            else:
                done.append(name)
        return done, unsupported
