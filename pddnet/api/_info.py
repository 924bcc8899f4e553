"""The handshake blob and the rendezvous by engine id and rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from .._errors import (
    LayoutMismatch,
    LocalProtocolError,
    PddnetError,
    RemoteProtocolError,
    TransferTimeout,
)
from ..control import ControlNode
from ..kv import KVLayout
from ._messages import Lookup, LookupReply, Register

__all__ = ["EndpointInfo", "Rendezvous"]

K_INFO_VERSION = 2  # 2: the model fingerprint; layouts carry their interior order
K_MAX_BLOB = 4096
_ROLES = ("prefill", "relay", "main")


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """Everything a peer needs to reach an endpoint; serialisable as :meth:`blob`.

    Args:
        name: the endpoint's control-plane node name (unique in the deployment).
        role: ``prefill``, ``relay`` or ``main``.
        engine_id: the engine instance, for rendezvous.
        rank: the worker's rank within the engine.
        control: the control-plane address (``tcp://host:port``).
        data: the data-plane address (``host:port``), "" for a pure sender.
        layout: the KV layout of the endpoint's pool.
        model: the model fingerprint the engine states (``model_id=`` of the
            endpoint): two endpoints exchange KV only if theirs are equal, ""
            included (see :meth:`check_peer`).
    """

    name: str
    role: str
    engine_id: str
    rank: int
    control: str
    data: str
    layout: KVLayout
    model: str = ""

    def check_peer(self, peer: EndpointInfo) -> None:
        """Refuse a peer whose KV would mean something else in our blocks.

        Raises:
            LayoutMismatch: if the KV layouts differ in anything but how
                layers map onto buffers (dtype, heads, block size, interior
                order, ...), or the model fingerprints differ; the message
                names both sides.
        """
        mine, theirs = f"{self.name} ({self.role})", f"{peer.name} ({peer.role})"
        self.layout.check_compatible(peer.layout, mine=mine, theirs=theirs)
        if self.model != peer.model:
            raise LayoutMismatch(
                f"different models: {self.model or '(none stated)'!r} at {mine} vs "
                f"{peer.model or '(none stated)'!r} at {theirs}",
                peer=peer.name,
            )

    def blob(self) -> bytes:
        """The handshake blob: versioned msgpack, safe to pass around as bytes."""
        return bytes(
            msgpack.packb(
                [
                    K_INFO_VERSION,
                    self.name,
                    self.role,
                    self.engine_id,
                    self.rank,
                    self.control,
                    self.data,
                    self.layout.to_dict(),
                    self.model,
                ]
            )
        )

    @classmethod
    def from_blob(cls, blob: bytes) -> EndpointInfo:
        """Parse a handshake blob.

        Raises:
            RemoteProtocolError: if it is malformed, oversized or of another version.
        """
        if len(blob) > K_MAX_BLOB:
            raise RemoteProtocolError(f"handshake blob of {len(blob)} bytes is too large")
        try:
            obj: Any = msgpack.unpackb(
                blob,
                strict_map_key=True,
                max_array_len=16,
                max_map_len=16,
                max_str_len=512,
                max_bin_len=0,
            )
            version = obj[0]
        except Exception as exc:
            raise RemoteProtocolError(f"malformed handshake blob: {exc}") from exc
        if version != K_INFO_VERSION:
            raise RemoteProtocolError(f"handshake blob version {version!r} is not supported")
        try:
            _, name, role, engine_id, rank, control, data, layout, model = obj
        except Exception as exc:
            raise RemoteProtocolError(f"malformed handshake blob: {exc}") from exc
        if role not in _ROLES or not all(
            isinstance(x, str) for x in (name, engine_id, control, data, model)
        ):
            raise RemoteProtocolError("handshake blob has a bad role or field type")
        if type(rank) is not int or not isinstance(layout, dict):
            raise RemoteProtocolError("handshake blob has a bad rank or layout")
        try:
            kv = KVLayout.from_dict(layout)
        except Exception as exc:
            raise RemoteProtocolError(f"handshake blob has a bad layout: {exc}") from exc
        return cls(name, role, engine_id, rank, control, data, kv, model)


class Rendezvous:
    """A directory of handshake blobs keyed by (engine id, rank), served by a node.

    Any :class:`ControlNode` can host it (``Rendezvous.serve(node)``); others
    :meth:`register` and :meth:`lookup` through their own node.
    """

    def __init__(self) -> None:
        self._blobs: dict[tuple[str, int], bytes] = {}

    @classmethod
    def serve(cls, node: ControlNode) -> Rendezvous:
        directory = cls()

        def on_register(peer: str, msg: Register) -> None:
            EndpointInfo.from_blob(msg.blob)  # reject garbage early
            directory._blobs[(msg.engine_id, msg.rank)] = msg.blob

        def on_lookup(peer: str, msg: Lookup) -> LookupReply:
            blob = directory._blobs.get((msg.engine_id, msg.rank))
            if blob is None:
                raise LocalProtocolError(f"nothing registered for {msg.engine_id}/{msg.rank}")
            return LookupReply(blob)

        node.route(Register, on_register)
        node.route(Lookup, on_lookup)
        return directory

    def publish(self, info: EndpointInfo) -> None:
        """Register ``info`` in this (locally served) directory."""
        self._blobs[(info.engine_id, info.rank)] = info.blob()

    async def wait_for(self, engine_id: str, rank: int, *, timeout: float = 30.0) -> EndpointInfo:
        """Wait until (``engine_id``, ``rank``) registers here; return its info.

        Raises:
            TransferTimeout: if it did not register within ``timeout`` seconds.
        """
        with trio.move_on_after(timeout):
            while (engine_id, rank) not in self._blobs:
                await trio.sleep(0.05)
            return EndpointInfo.from_blob(self._blobs[(engine_id, rank)])
        raise TransferTimeout(f"{engine_id}/{rank} did not register within {timeout:g}s")

    @staticmethod
    async def join(
        endpoint: Any, at: str, address: str, peers: Sequence[str], *, timeout: float = 30.0
    ) -> None:
        """Register ``endpoint`` on the rendezvous node ``at`` (``address``), then
        look up every engine id in ``peers`` (rank 0) and connect to it, retrying
        until each is registered.

        Raises:
            TransferTimeout: if that does not happen within ``timeout`` seconds.
        """
        await endpoint.node.connect(at, address)
        with trio.move_on_after(timeout):
            while True:
                try:
                    await Rendezvous.register(endpoint.node, at, endpoint.info(), timeout=1.0)
                    break
                except PddnetError:
                    await trio.sleep(0.1)
            for engine_id in peers:
                while True:
                    try:
                        info = await Rendezvous.lookup(endpoint.node, at, engine_id, 0, timeout=1.0)
                        break
                    except PddnetError:
                        await trio.sleep(0.1)
                await endpoint.connect_peer(info)
            return
        raise TransferTimeout(f"rendezvous at {at} did not complete within {timeout:g}s")

    @staticmethod
    async def register(
        node: ControlNode, at: str, info: EndpointInfo, *, timeout: float = 5.0
    ) -> None:
        """Publish ``info`` on the rendezvous node ``at`` (already connected)."""
        await node.request(at, Register(info.engine_id, info.rank, info.blob()), timeout=timeout)

    @staticmethod
    async def lookup(
        node: ControlNode, at: str, engine_id: str, rank: int, *, timeout: float = 5.0
    ) -> EndpointInfo:
        """Find the endpoint registered as (``engine_id``, ``rank``) on ``at``.

        Raises:
            RemoteCallError: if nothing is registered under that key.
        """
        reply = await node.request(at, Lookup(engine_id, rank), timeout=timeout)
        assert isinstance(reply, LookupReply)
        return EndpointInfo.from_blob(reply.blob)
