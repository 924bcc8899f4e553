"""The directory contract every implementation keeps, and the watch both share."""

from __future__ import annotations

import abc
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import trio

from .._errors import PddnetError, PeerUnavailable, TransferTimeout
from ..api import EndpointInfo
from ._member import DirectoryEvent, Load, Member, MemberLeft

__all__ = ["Directory", "DirectoryStats", "Watch"]


@dataclass(frozen=True, slots=True)
class DirectoryStats:
    """A snapshot of one directory handle's counters.

    Attributes:
        registered: members registered through this handle now.
        lease_id: the etcd lease they are held under (0: none, or in memory).
        lease_ttl: the TTL the store granted, seconds (0 in memory).
        keepalives: lease keep-alives answered.
        keepalive_failures: keep-alives that failed (store unreachable).
        leases_lost: times the lease had expired and everything was
            registered again under a new one.
        malformed: stored values skipped by a listing or a watch because they
            did not parse (each one also logged, rate-limited).
    """

    registered: int
    lease_id: int
    lease_ttl: int
    keepalives: int
    keepalive_failures: int
    leases_lost: int
    malformed: int


class Watch:
    """The events of one :meth:`Directory.watch`, as an async iterator.

    The current members come first (one :class:`MemberJoined` each), then
    every change after that snapshot, in order. A watch that breaks (the store
    restarted, became unreachable, or the watcher fell behind) ends by raising
    the error that broke it, never silently: open a new watch to resync.
    """

    def __init__(self, receive: trio.MemoryReceiveChannel[DirectoryEvent]) -> None:
        self._receive = receive
        self.error: PddnetError | None = None  # set by the feeder before it closes the channel

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> DirectoryEvent:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            if self.error is not None:
                raise self.error from None
            raise StopAsyncIteration from None


class Directory(abc.ABC):
    """Where instances find each other: members by role, with load, and changes.

    Each instance registers its :class:`~pddnet.api.EndpointInfo` (the
    handshake blob, its role and name) and a :class:`Load` summary; the
    others list members by role, or watch them join, update and leave. A
    handle's registrations last until :meth:`deregister`, :meth:`aclose`, or
    (on a store with leases) until its process dies and the lease expires.

    Implementations: :class:`~pddnet.directory.MemoryDirectory` (one process,
    one host; the embedded default) and
    :class:`~pddnet.directory.EtcdDirectory` (a cluster).
    """

    cluster: str

    @abc.abstractmethod
    async def register(self, info: EndpointInfo, load: Load | None = None) -> None:
        """Publish ``info`` under its role and name, with ``load``.

        Registering a name this handle already holds replaces its value.

        Raises:
            LocalProtocolError: if the name cannot be a key or the value is too large.
            PeerUnavailable, TransferTimeout: if the store does not answer.
        """

    @abc.abstractmethod
    async def update_load(self, name: str, load: Load) -> None:
        """Publish a new load summary for ``name``, registered through this handle.

        Raises:
            LocalProtocolError: if this handle did not register ``name``.
            PeerUnavailable, TransferTimeout: if the store does not answer.
        """

    @abc.abstractmethod
    async def deregister(self, name: str) -> None:
        """Remove ``name`` (registered through this handle); others see it leave.

        Raises:
            LocalProtocolError: if this handle did not register ``name``.
            PeerUnavailable, TransferTimeout: if the store does not answer.
        """

    @abc.abstractmethod
    async def members(self, role: str | None = None) -> list[Member]:
        """The current members of ``role`` (every role if None), by name.

        Values that do not parse are skipped, counted in ``malformed`` and logged.

        Raises:
            PeerUnavailable, TransferTimeout, RemoteProtocolError: if the store
                does not answer, or answers garbage.
        """

    @abc.abstractmethod
    async def get(self, role: str, name: str) -> Member | None:
        """The member ``name`` of ``role``, or None if it is not registered.

        Raises:
            RemoteProtocolError: if its stored value is malformed or oversized.
            PeerUnavailable, TransferTimeout: if the store does not answer.
        """

    @abc.abstractmethod
    def watch(self, role: str | None = None) -> AbstractAsyncContextManager[Watch]:
        """``async with d.watch(role) as events:`` the members of ``role`` (every
        role if None) now, then their joins, updates and leaves (see :class:`Watch`).

        Raises:
            PeerUnavailable, TransferTimeout: on entry, if the store does not
                answer; from the iterator, when the watch breaks.
        """

    @abc.abstractmethod
    def statistics(self) -> DirectoryStats:
        """A frozen snapshot of this handle's counters."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Deregister everything this handle registered (best effort) and stop.

        Cancelled, the registrations may stay until their lease expires.
        """

    async def wait_for(self, role: str, name: str, *, timeout: float = 30.0) -> Member:
        """Wait until ``name`` of ``role`` is registered; return it.

        Raises:
            TransferTimeout: if it did not register within ``timeout`` seconds.
            PeerUnavailable: if the store does not answer.
        """
        with trio.move_on_after(timeout):
            async with self.watch(role) as events:
                async for event in events:
                    if not isinstance(event, MemberLeft) and event.member.name == name:
                        return event.member
            raise PeerUnavailable(f"the directory closed while waiting for {role}/{name}")
        raise TransferTimeout(f"{role}/{name} did not register within {timeout:g}s", peer=name)

    async def __aenter__(self) -> Directory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
