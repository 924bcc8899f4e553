"""The in-memory directory: one process, one host, no store to run.

The embedded default, as :class:`pddnet.api.Rendezvous` is for handshakes by
engine id: the members live in this object, so they die with the process and
need no lease. Endpoints of one process share one :class:`MemoryDirectory`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from .._errors import LocalProtocolError, TransportError
from ..api import EndpointInfo
from ._base import Directory, DirectoryStats, Watch
from ._member import (
    DirectoryEvent,
    Load,
    Member,
    MemberJoined,
    MemberLeft,
    MemberUpdated,
    encode_member,
    role_prefix,
)

__all__ = ["MemoryDirectory"]

K_WATCH_BUFFER = 4096  # events a watcher may fall behind before its watch breaks


class MemoryDirectory(Directory):
    """A :class:`Directory` held in this process's memory.

    Args:
        cluster: the cluster name (as in :class:`EtcdDirectory`; it only
            checks names here).
    """

    def __init__(self, cluster: str = "default") -> None:
        role_prefix(cluster, None)  # checks the name
        self.cluster = cluster
        self._members: dict[tuple[str, str], Member] = {}
        self._revision = 0
        # each watcher's channel -> (the role it watches or None, its Watch)
        self._watchers: dict[trio.MemorySendChannel[DirectoryEvent], tuple[str | None, Watch]] = {}

    def _publish(self, event: DirectoryEvent) -> None:
        role = event.role if isinstance(event, MemberLeft) else event.member.role
        for send, (wanted, watch) in list(self._watchers.items()):
            if wanted not in (None, role):
                continue
            try:
                send.send_nowait(event)
            except trio.WouldBlock:
                watch.error = TransportError(
                    f"watcher fell more than {K_WATCH_BUFFER} events behind; watch again"
                )
                send.close()
                del self._watchers[send]

    async def register(self, info: EndpointInfo, load: Load | None = None) -> None:
        await trio.lowlevel.checkpoint()
        encode_member(info, load or Load())  # the same checks as a store
        key = (info.role, info.name)
        self._revision += 1
        member = Member(info, load or Load(), self._revision)
        joined = key not in self._members
        self._members[key] = member
        self._publish(MemberJoined(member) if joined else MemberUpdated(member))

    def _mine(self, name: str) -> Member:
        for (_, n), m in self._members.items():
            if n == name:
                return m
        raise LocalProtocolError(f"{name!r} is not registered in this directory")

    async def update_load(self, name: str, load: Load) -> None:
        await trio.lowlevel.checkpoint()
        old = self._mine(name)
        self._revision += 1
        member = Member(old.info, load, self._revision)
        self._members[(old.role, name)] = member
        self._publish(MemberUpdated(member))

    async def deregister(self, name: str) -> None:
        await trio.lowlevel.checkpoint()
        self._drop(self._mine(name))

    def _drop(self, member: Member) -> None:
        del self._members[(member.role, member.name)]
        self._revision += 1
        self._publish(MemberLeft(member.role, member.name, self._revision))

    async def members(self, role: str | None = None) -> list[Member]:
        await trio.lowlevel.checkpoint()
        role_prefix(self.cluster, role)  # checks the role
        found = [m for (r, _), m in self._members.items() if role in (None, r)]
        return sorted(found, key=lambda m: m.name)

    async def get(self, role: str, name: str) -> Member | None:
        await trio.lowlevel.checkpoint()
        return self._members.get((role, name))

    @asynccontextmanager
    async def watch(self, role: str | None = None) -> AsyncIterator[Watch]:
        current = await self.members(role)
        send, receive = trio.open_memory_channel[DirectoryEvent](max(K_WATCH_BUFFER, len(current)))
        for m in current:
            send.send_nowait(MemberJoined(m))
        watch = Watch(receive)
        self._watchers[send] = (role, watch)
        try:
            yield watch
        finally:
            self._watchers.pop(send, None)
            send.close()

    def statistics(self) -> DirectoryStats:
        return DirectoryStats(len(self._members), 0, 0, 0, 0, 0, 0)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        for member in list(self._members.values()):
            self._drop(member)
        for send in list(self._watchers):
            send.close()
        self._watchers.clear()
