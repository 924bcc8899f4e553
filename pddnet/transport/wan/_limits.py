"""Resource bounds of the WAN receiver: what one peer (or a stranger) may make it hold.

Every bound is a field of :class:`WanLimits`; exceeding one raises (or, where
no caller waits, logs and counts) a :class:`WanLimitExceeded`, a
:class:`~pddnet.ResourceLimitError` that names the limit, its value, what was
asked for, and the peer/transfer. A refused grant is refused *before* it is
registered, so no byte can be accepted for it and the receiver's accounting
is unchanged; a refused connection is closed before its first byte is read.

What each bound protects (docs/wan.md, "Limits", has the table):

* ``max_transfers`` / ``max_transfers_per_peer``: live grants, so one peer's
  flood of requests cannot take every grant slot;
* ``max_bytes`` / ``max_bytes_per_peer``: total destination bytes of live
  grants (the receive memory pinned for a peer);
* ``max_connections`` / ``max_connections_per_peer``: data connections, so a
  connection flood cannot exhaust descriptors and socket buffers. Each
  connection reads one chunk at a time, so this also bounds the chunks in
  progress (at most ``max_connections``, each at most ``max_chunk`` bytes,
  written straight into granted memory, nothing buffered);
* ``max_handshakes`` / ``max_handshakes_per_peer``: connections still in TLS
  or authentication (strangers have not proved anything yet: their slots are
  few and time-bounded, and one address cannot take them all). A full table
  sheds its *oldest* handshake rather than refusing the newest connection
  (see :mod:`._receiver`), so strangers that keep every slot cannot lock an
  honest peer out: it only has to finish before that many newer connections
  arrive;
* ``handshake_timeout``: the most one connection may spend in TLS and the
  challenge-response together (an honest one needs a few round trips);
* ``body_timeout``: a chunk header followed by a slow or absent payload
  (slowloris) holds its connection and its byte range at most this long;
* ``send_timeout``: a frame (an ACK) that finds the connection's bounded send
  buffer full waits at most this long for the peer to read, then the
  connection is dropped: a peer that never reads its ACKs cannot park a
  connection task, or the grant timer's CANCELLED broadcast, on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._errors import LocalProtocolError, ResourceLimitError

__all__ = ["WanLimitExceeded", "WanLimits"]


@dataclass(frozen=True, slots=True)
class WanLimits:
    """Resource bounds of a :class:`~pddnet.transport.wan.WanReceiver`.

    ``None`` turns a bound off. "Peer" is the name given to
    :meth:`WanReceiver.grant` for the grant bounds, and the remote IP address
    for the connection bounds.

    The receiver also keeps ``max_connections`` to at most half, and
    ``max_handshakes`` and ``max_handshakes_per_peer`` to at most a sixteenth,
    of the process's descriptor limit (soft ``RLIMIT_NOFILE``), even where they
    are None, so that its connections alone cannot exhaust it.

    Args:
        max_transfers: live grants at once.
        max_transfers_per_peer: live grants of one peer at once.
        max_bytes: bytes of live grants at once (None: bounded by the pool).
        max_bytes_per_peer: bytes of live grants of one peer (its receive memory).
        max_connections: data connections at once (handshaking or not).
        max_connections_per_peer: data connections from one IP address.
        max_handshakes: connections still in TLS/authentication at once.
        max_handshakes_per_peer: of those, from one IP address.
        handshake_timeout: seconds a connection has for TLS and authentication.
        body_timeout: seconds from a chunk header to the end of its payload.
        send_timeout: seconds a frame to the peer may wait for room in the
            connection's send buffer before the connection is dropped.
    """

    max_transfers: int | None = 1024
    max_transfers_per_peer: int | None = 512
    max_bytes: int | None = None
    max_bytes_per_peer: int | None = 64 << 30
    max_connections: int | None = 1024
    max_connections_per_peer: int | None = 256
    max_handshakes: int | None = 64
    max_handshakes_per_peer: int | None = 32
    handshake_timeout: float | None = 3.0
    body_timeout: float | None = 30.0
    send_timeout: float | None = 2.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise LocalProtocolError(f"WanLimits.{name} must be positive or None, not {value}")


class WanLimitExceeded(ResourceLimitError):
    """A :class:`WanLimits` bound refused something.

    Attributes:
        limit: the :class:`WanLimits` field name.
        maximum: its value.
        requested: what the refused action would have brought the total to.
    """

    def __init__(
        self,
        limit: str,
        maximum: float,
        requested: float,
        *,
        peer: str | None = None,
        transfer_id: int | None = None,
    ) -> None:
        super().__init__(
            f"WAN receiver limit {limit} exceeded",
            peer=peer,
            transfer_id=transfer_id,
        )
        self.limit = limit
        self.maximum = maximum
        self.requested = requested

    def context(self) -> dict[str, Any]:
        ctx = super().context()
        ctx.update(limit=self.limit, maximum=self.maximum, requested=self.requested)
        return ctx


def check(
    limits: WanLimits,
    name: str,
    current: float,
    adding: float,
    *,
    peer: str | None = None,
    transfer_id: int | None = None,
) -> None:
    """Raise :class:`WanLimitExceeded` if ``current + adding`` passes ``limits.<name>``."""
    maximum = getattr(limits, name)
    if maximum is not None and current + adding > maximum:
        raise WanLimitExceeded(name, maximum, current + adding, peer=peer, transfer_id=transfer_id)
