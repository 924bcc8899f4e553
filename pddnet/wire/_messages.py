"""Core control messages (type ids 0-15). Subsystems register their own ranges:

======  ==========================================
ids     owner
======  ==========================================
0-15    core (this module)
16-31   WAN transport: grants, transfer control
32-47   handoff: token batches, acks
48-63   decode-side radix cache and dual path
64-79   engine-facing API, rendezvous, leases
80-95   reliability and fault injection
======  ==========================================
"""

from __future__ import annotations

from ._control import Message, message

__all__ = ["ErrorReply", "Hello", "Ping", "Pong"]


@message(0)
class Ping(Message):
    """Liveness and latency probe; answered by :class:`Pong` with the same payload."""

    payload: bytes = b""


@message(1)
class Pong(Message):
    payload: bytes = b""


@message(2)
class ErrorReply(Message):
    """A request failed on the peer. ``code`` is the error class name."""

    code: str
    reason: str


@message(3)
class Hello(Message):
    """First message between two nodes: who I am and how to reach my data plane."""

    name: str
    version: int
    handshake: bytes = b""
