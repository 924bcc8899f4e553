"""Control-plane messages of the WAN transport (type ids 16-31).

The receiver sends :class:`WanGrant` to the sender (usually as the reply to a
:class:`WanGrantRequest`); either side may send :class:`WanCancel`. The data
plane itself carries its own cancel/ack frames (see ``_framing``), so these
messages are only the rendezvous.
"""

from __future__ import annotations

from ...wire import Message, message
from .._base import Grant

__all__ = ["WanCancel", "WanGrant", "WanGrantRequest"]


@message(16)
class WanGrantRequest(Message):
    """Sender to receiver: please grant ``total`` bytes for ``request_id``."""

    request_id: str
    total: int
    num_layers: int = 0


@message(17)
class WanGrant(Message):
    """Receiver to sender: a :class:`~pddnet.transport.Grant`, serialised."""

    transfer_id: int
    total: int
    layer_ends: list[int]
    address: str
    request_id: str = ""

    @classmethod
    def from_grant(cls, grant: Grant, request_id: str = "") -> WanGrant:
        return cls(
            grant.transfer_id, grant.total, list(grant.layer_ends), grant.address, request_id
        )

    def to_grant(self) -> Grant:
        return Grant(self.transfer_id, self.total, tuple(self.layer_ends), self.address)


@message(18)
class WanCancel(Message):
    """Either side: the transfer is cancelled (``reason`` for logs)."""

    transfer_id: int
    reason: str = ""
