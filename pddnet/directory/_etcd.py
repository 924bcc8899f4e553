"""The directory on etcd, through etcd's v3 JSON gateway (``/v3/...`` over HTTP).

Theory of operation:

- A handle holds one lease. :meth:`EtcdDirectory.register` grants it on
  first use (etcd may raise the TTL to its minimum: the granted TTL is the one
  kept) and puts each member's value under it. A task sends a keep-alive
  every third of the TTL. A process that dies stops sending them, and etcd
  deletes its keys when the TTL runs out: watchers see a ``DELETE`` and
  report :class:`MemberLeft`. So a dead instance is gone within the TTL plus
  etcd's expiry check (about half a second).
- A keep-alive that finds the lease expired (the handle was cut off from
  etcd longer than the TTL, or etcd lost it) grants a new lease and puts every
  member again: the others see it leave, then join. A keep-alive that cannot
  reach etcd is counted and retried at the next tick; etcd expires the lease
  if no tick gets through within the TTL.
- A watch lists the prefix at revision R, reports those members as joined,
  then streams every change from R + 1, so nothing falls between the two. A
  heartbeat (a count-only range, every ``timeout`` seconds) runs beside it:
  an etcd that dies closes the stream, one that becomes unreachable stops
  answering the heartbeat, and either way the watch raises, never hangs.
- Every call has a deadline (``timeout``), every answer a size bound, and
  every value is checked by :func:`~pddnet.directory._member.decode_member`.
  The gateway speaks JSON with base64 keys and values and int64s as strings.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

from .._errors import (
    LocalProtocolError,
    PddnetError,
    PeerUnavailable,
    RemoteCallError,
    RemoteProtocolError,
    TransferTimeout,
    TransportError,
)
from .._ratelog import LogLimiter
from ..api import EndpointInfo
from ._base import Directory, DirectoryStats, Watch
from ._http import HttpAddress, post_json, post_stream
from ._member import (
    K_MAX_VALUE,
    DirectoryEvent,
    Load,
    Member,
    MemberJoined,
    MemberLeft,
    MemberUpdated,
    decode_member,
    encode_member,
    member_key,
    role_prefix,
    split_key,
)

__all__ = ["EtcdDirectory"]

log = logging.getLogger("pddnet.directory")

K_MAX_MEMBERS = 4096  # members one listing returns; more is refused
K_MAX_B64_VALUE = 4 * ((K_MAX_VALUE + 2) // 3)
# a listing of K_MAX_MEMBERS base64 values with their keys and JSON around them
K_MAX_RESPONSE = 32 << 20
K_WATCH_BUFFER = 1024  # decoded events queued for a slow watcher (then TCP backpressure)
# gRPC status codes the gateway answers with (grpc/codes): the ones we act on
K_GRPC_DEADLINE_EXCEEDED = 4
K_GRPC_NOT_FOUND = 5  # "requested lease not found"
K_GRPC_UNAVAILABLE = 14


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _range_end(prefix: str) -> str:
    """etcd's end of the range of keys starting with ``prefix`` (its last byte + 1)."""
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


class EtcdDirectory(Directory):
    """A :class:`Directory` on an etcd cluster, reached through its JSON gateway.

    ``async with EtcdDirectory(url) as d:`` starts the lease keep-alive;
    leaving the block revokes the lease, so this handle's members leave at
    once (a process that dies instead leaves within the TTL).

    Args:
        url: an etcd client URL, ``http://host:port`` (no TLS or auth here).
        cluster: the cluster name: members live under ``/pddnet/<cluster>/``.
        ttl: the lease TTL asked for, whole seconds (etcd may grant more; see
            :meth:`statistics`).
        timeout: the deadline of each call to etcd, seconds; also the watch
            heartbeat's period.
    """

    def __init__(
        self, url: str, *, cluster: str = "default", ttl: int = 10, timeout: float = 2.0
    ) -> None:
        role_prefix(cluster, None)  # checks the name
        if type(ttl) is not int or ttl < 1:
            raise LocalProtocolError(f"lease TTL must be a whole number of seconds >= 1: {ttl!r}")
        self.cluster = cluster
        self.url = url
        self._addr = HttpAddress(url)
        self._ttl = ttl
        self._timeout = timeout
        self._mine: dict[str, tuple[EndpointInfo, Load]] = {}
        self._lease = 0  # 0: none granted, or lost
        self._lease_ttl = 0
        self._synced = True  # every member of _mine is stored under _lease
        self._lock = trio.Lock()  # one lease change or put at a time
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._limiter = LogLimiter(log)
        self._keepalives = self._keepalive_failures = self._leases_lost = self._malformed = 0

    # -- the gateway ------------------------------------------------------------

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        status, obj = await post_json(
            self._addr, path, payload, timeout=self._timeout, max_bytes=K_MAX_RESPONSE
        )
        error = obj.get("error")
        if status != 200 or error is not None:
            code = obj.get("code", error.get("code") if isinstance(error, dict) else None)
            message = obj.get("message", error)
            text = f"etcd at {self.url} refused {path}: {message!s:.200} (gRPC code {code})"
            if code == K_GRPC_UNAVAILABLE:
                raise PeerUnavailable(text, peer=self.url)
            if code == K_GRPC_DEADLINE_EXCEEDED:
                raise TransferTimeout(text, peer=self.url)
            raise RemoteCallError(text, code=f"grpc-{code}", peer=self.url)
        return obj

    def _int(self, obj: dict[str, Any], field: str) -> int:
        """An int64 field (a string in the gateway's JSON; absent means 0)."""
        try:
            return int(obj.get(field, 0))
        except (TypeError, ValueError) as exc:
            raise RemoteProtocolError(
                f"etcd at {self.url}: {field} is not an integer", peer=self.url
            ) from exc

    def _decode_kv(self, kv: Any) -> Member:
        if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
            raise RemoteProtocolError(f"etcd at {self.url}: a malformed key-value", peer=self.url)
        value = kv.get("value", "")
        if not isinstance(value, str):
            raise RemoteProtocolError(f"etcd at {self.url}: a malformed value", peer=self.url)
        if len(value) > K_MAX_B64_VALUE:
            raise RemoteProtocolError(
                f"etcd at {self.url}: a value over {K_MAX_VALUE} bytes", peer=self.url
            )
        try:
            key = base64.b64decode(kv["key"], validate=True).decode()
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise RemoteProtocolError(f"etcd at {self.url}: bad base64", peer=self.url) from exc
        return decode_member(key, self.cluster, raw, self._int(kv, "mod_revision"))

    def _skip(self, exc: PddnetError) -> None:
        self._malformed += 1
        self._limiter.warning("malformed", "skipped a directory value: %s", exc)

    async def _range(self, prefix: str) -> tuple[list[Member], int]:
        obj = await self._call(
            "/v3/kv/range",
            {"key": _b64(prefix), "range_end": _range_end(prefix), "limit": K_MAX_MEMBERS},
        )
        header = obj.get("header")
        kvs = obj.get("kvs", [])
        if not isinstance(header, dict) or not isinstance(kvs, list):
            raise RemoteProtocolError(f"etcd at {self.url}: a malformed range", peer=self.url)
        if obj.get("more"):
            raise RemoteProtocolError(
                f"more than {K_MAX_MEMBERS} members under {prefix}", peer=self.url
            )
        found = []
        for kv in kvs:
            try:
                found.append(self._decode_kv(kv))
            except RemoteProtocolError as exc:
                self._skip(exc)
        return sorted(found, key=lambda m: m.name), self._int(header, "revision")

    # -- the lease --------------------------------------------------------------

    async def _grant(self) -> None:
        obj = await self._call("/v3/lease/grant", {"TTL": self._ttl})
        self._lease, self._lease_ttl = self._int(obj, "ID"), self._int(obj, "TTL")
        if self._lease == 0 or self._lease_ttl < 1:
            raise RemoteProtocolError(f"etcd at {self.url} granted no lease: {obj}", peer=self.url)

    async def _put(self, info: EndpointInfo, load: Load) -> bool:
        """Put one member under the lease; whether that needed a new lease."""
        key = member_key(self.cluster, info.role, info.name)
        value = base64.b64encode(encode_member(info, load)).decode()
        fresh = False
        for _ in range(2):  # a second try under a fresh lease if it had expired
            if self._lease == 0:
                await self._grant()
                fresh = True
            try:
                await self._call(
                    "/v3/kv/put", {"key": _b64(key), "value": value, "lease": str(self._lease)}
                )
                return fresh
            except RemoteCallError as exc:
                if exc.code != f"grpc-{K_GRPC_NOT_FOUND}":
                    raise
                self._lease = 0
                self._leases_lost += 1
        raise PeerUnavailable(f"etcd at {self.url} lost two leases in a row", peer=self.url)

    async def _store(self, info: EndpointInfo, load: Load) -> None:
        """Put one member; if that needed a new lease, put the others under it too."""
        fresh = await self._put(info, load)
        self._mine[info.name] = (info, load)
        if (fresh and len(self._mine) > 1) or not self._synced:
            await self._resync()

    async def _resync(self) -> None:
        """Put every member again (under a new lease if the lease is gone),
        until one pass needs no new lease."""
        self._synced = False
        if self._lease == 0:
            await self._grant()
        while any([await self._put(info, load) for info, load in list(self._mine.values())]):
            pass
        self._synced = True

    async def _keep_alive(self) -> None:
        while True:
            await trio.sleep(self._lease_ttl / 3)
            try:
                async with self._lock:
                    if self._lease == 0 and not self._mine:
                        continue  # nothing to hold a lease for
                    if self._lease and self._synced:
                        obj = await self._call("/v3/lease/keepalive", {"ID": str(self._lease)})
                        result = obj.get("result")
                        if isinstance(result, dict) and self._int(result, "TTL") > 0:
                            self._keepalives += 1
                            continue
                        self._lease = 0
                        self._leases_lost += 1
                        log.warning("lease of %s expired: registering again", self.cluster)
                    await self._resync()
            except PddnetError as exc:
                self._keepalive_failures += 1
                self._limiter.warning("keepalive", "directory keep-alive failed: %s", exc)

    # -- the Directory API ------------------------------------------------------

    async def __aenter__(self) -> EtcdDirectory:
        stack = AsyncExitStack()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        return self

    async def register(self, info: EndpointInfo, load: Load | None = None) -> None:
        if self._nursery is None:
            raise LocalProtocolError("register inside `async with EtcdDirectory(...)`")
        async with self._lock:
            first = self._lease_ttl == 0
            await self._store(info, load or Load())
        if first:
            self._nursery.start_soon(self._keep_alive)

    def _check_mine(self, name: str) -> EndpointInfo:
        if name not in self._mine:
            raise LocalProtocolError(f"{name!r} is not registered through this handle")
        return self._mine[name][0]

    async def update_load(self, name: str, load: Load) -> None:
        info = self._check_mine(name)
        async with self._lock:
            await self._store(info, load)

    async def deregister(self, name: str) -> None:
        info = self._check_mine(name)
        async with self._lock:
            key = member_key(self.cluster, info.role, name)
            await self._call("/v3/kv/deleterange", {"key": _b64(key)})
            del self._mine[name]

    async def members(self, role: str | None = None) -> list[Member]:
        found, _ = await self._range(role_prefix(self.cluster, role))
        return found

    async def get(self, role: str, name: str) -> Member | None:
        obj = await self._call("/v3/kv/range", {"key": _b64(member_key(self.cluster, role, name))})
        kvs = obj.get("kvs", [])
        if not isinstance(kvs, list) or len(kvs) > 1:
            raise RemoteProtocolError(f"etcd at {self.url}: a malformed range", peer=self.url)
        return self._decode_kv(kvs[0]) if kvs else None

    async def granted_ttl(self, role: str, name: str) -> int:
        """The TTL etcd granted the lease that holds ``name``'s key, seconds
        (0 if it is not registered or holds no lease).

        Raises:
            PeerUnavailable, TransferTimeout: if etcd does not answer.
        """
        key = member_key(self.cluster, role, name)
        kvs = (await self._call("/v3/kv/range", {"key": _b64(key), "keys_only": True})).get("kvs")
        kv = kvs[0] if isinstance(kvs, list) and len(kvs) == 1 else None
        lease = self._int(kv, "lease") if isinstance(kv, dict) else 0
        if lease == 0:
            return 0
        return self._int(await self._call("/v3/lease/timetolive", {"ID": str(lease)}), "grantedTTL")

    @asynccontextmanager
    async def watch(self, role: str | None = None) -> AsyncIterator[Watch]:
        prefix = role_prefix(self.cluster, role)
        current, revision = await self._range(prefix)
        send, receive = trio.open_memory_channel[DirectoryEvent](max(K_WATCH_BUFFER, len(current)))
        for m in current:
            send.send_nowait(MemberJoined(m))
        watch = Watch(receive)
        create = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _range_end(prefix),
                "start_revision": str(revision + 1),
            }
        }
        async with (
            post_stream(
                self._addr, "/v3/watch", create, timeout=self._timeout, max_line=K_MAX_RESPONSE
            ) as results,
            trio.open_nursery() as nursery,
        ):
            created: dict[str, Any] | None = None
            with trio.move_on_after(self._timeout):
                created = await results.__anext__()
            if created is None:
                raise TransferTimeout(
                    f"etcd at {self.url} did not create the watch within {self._timeout:g}s",
                    peer=self.url,
                )
            if not isinstance(created.get("result"), dict) or not created["result"].get("created"):
                raise RemoteProtocolError(
                    f"etcd at {self.url} did not create the watch: {created!s:.200}", peer=self.url
                )

            async def guard(task: Any) -> None:
                try:
                    await task()
                except PddnetError as exc:
                    watch.error = exc
                nursery.cancel_scope.cancel()  # first: a pump blocked in send() is cancelled
                send.close()

            nursery.start_soon(guard, lambda: self._pump(results, send))
            nursery.start_soon(guard, lambda: self._heartbeat(prefix))
            try:
                yield watch
            finally:
                nursery.cancel_scope.cancel()

    async def _pump(
        self,
        results: AsyncIterator[dict[str, Any]],
        send: trio.MemorySendChannel[DirectoryEvent],
    ) -> None:
        async for obj in results:
            result = obj.get("result")
            if not isinstance(result, dict):
                raise RemoteProtocolError(f"etcd watch at {self.url}: {obj!s:.200}", peer=self.url)
            if result.get("canceled") or result.get("compact_revision"):
                raise TransportError(
                    f"etcd at {self.url} ended the watch: {result.get('cancel_reason', '')!s:.200}"
                    " (history compacted?); watch again",
                    peer=self.url,
                )
            events = result.get("events", [])
            if not isinstance(events, list):
                raise RemoteProtocolError(f"etcd watch at {self.url}: bad events", peer=self.url)
            for ev in events:
                try:
                    event = self._decode_event(ev)
                except RemoteProtocolError as exc:
                    self._skip(exc)
                    continue
                await send.send(event)

    def _decode_event(self, ev: Any) -> DirectoryEvent:
        kv = ev.get("kv") if isinstance(ev, dict) else None
        if not isinstance(kv, dict):
            raise RemoteProtocolError(f"etcd watch at {self.url}: a malformed event", peer=self.url)
        if ev.get("type", "PUT") == "DELETE":
            try:
                key = base64.b64decode(kv.get("key", ""), validate=True).decode()
            except (binascii.Error, UnicodeDecodeError, TypeError) as exc:
                raise RemoteProtocolError(f"etcd at {self.url}: bad base64", peer=self.url) from exc
            role, name = split_key(self.cluster, key)
            return MemberLeft(role, name, self._int(kv, "mod_revision"))
        member = self._decode_kv(kv)
        return MemberJoined(member) if self._int(kv, "version") == 1 else MemberUpdated(member)

    async def _heartbeat(self, prefix: str) -> None:
        ping = {"key": _b64(prefix), "range_end": _range_end(prefix), "count_only": True}
        while True:
            await trio.sleep(self._timeout)
            await self._call("/v3/kv/range", ping)

    def statistics(self) -> DirectoryStats:
        return DirectoryStats(
            registered=len(self._mine),
            lease_id=self._lease,
            lease_ttl=self._lease_ttl,
            keepalives=self._keepalives,
            keepalive_failures=self._keepalive_failures,
            leases_lost=self._leases_lost,
            malformed=self._malformed,
        )

    async def aclose(self) -> None:
        """Revoke the lease (this handle's members leave at once) and stop.

        If etcd cannot be reached the members stay until the lease expires.
        Cancelled, likewise.
        """
        try:
            if self._lease:
                with trio.move_on_after(self._timeout):
                    await self._call("/v3/lease/revoke", {"ID": str(self._lease)})
        except PddnetError as exc:
            log.warning("could not revoke the directory lease (it expires in its TTL): %s", exc)
        finally:
            self._lease = 0
            self._mine.clear()
            stack, nursery = self._stack, self._nursery
            self._stack = self._nursery = None
            if nursery is not None:
                nursery.cancel_scope.cancel()
            if stack is not None:
                await stack.aclose()
