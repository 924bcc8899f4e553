"""Data paths: the transport interface, and the WAN (multi-stream TCP) transport.

Every transport implements :class:`Sender` / :class:`Receiver` /
:class:`Transfer` and passes :func:`pddnet.transport.testing.check_transport`.
"""

from ._base import Grant, ProgressCallback, Receiver, Sender, Transfer, TransferState
from ._intervals import IntervalSet

__all__ = [
    "Grant",
    "IntervalSet",
    "ProgressCallback",
    "Receiver",
    "Sender",
    "Transfer",
    "TransferState",
]
