"""Dual-path send: one request's KV to RLD over the local path and to MD over the WAN.

P holds a request's KV blocks. RLD (same datacenter) must get *every* block,
fast, over the local path; MD (across the WAN) gets only the blocks its DRC
does not hold (:class:`~pddnet.cache.DeltaPlan`). :class:`DualTransfer` drives
both at once, layer by layer as prefill produces layers:

* each destination gets one transfer per layer, started by
  :meth:`DualTransfer.layer_ready`, so completion is known per destination and
  per layer exactly (``wait_layer``), and a layer's bytes can move while prefill
  computes the next;
* destinations are independent: cancelling MD (strange traffic: RLD finished
  before MD's copy landed) leaves RLD's transfers running, and a failure on
  one path does not touch the other.

The receivers grant per layer as well (:func:`layer_plans` builds the ranges
for both sides from block ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from .._errors import LocalProtocolError, PddnetError, TransferCancelled
from ..kv import ByteRanges, KVLayout, TransferPlan
from ._base import Grant, Sender, Transfer, TransferState

__all__ = ["DualTransfer", "LayerPlans", "PathPlan", "layer_plans"]


@dataclass(frozen=True, slots=True)
class LayerPlans:
    """Per-layer source and destination ranges of one block mapping."""

    src: tuple[ByteRanges, ...]
    dst: tuple[ByteRanges, ...]

    @property
    def total(self) -> int:
        return sum(r.total for r in self.src)


def layer_plans(
    layout: KVLayout, src_pool_blocks: int, src_ids: Any, dst_pool_blocks: int, dst_ids: Any
) -> LayerPlans:
    """Split the plan copying ``src_ids[i] -> dst_ids[i]`` into one plan per layer.

    Raises:
        LayoutMismatch: as :meth:`TransferPlan.build`.
    """
    plan = TransferPlan.build(layout, src_pool_blocks, src_ids, dst_pool_blocks, dst_ids)
    layers = range(layout.num_layers)
    return LayerPlans(
        tuple(plan.src.select_layers([i]) for i in layers),
        tuple(plan.dst.select_layers([i]) for i in layers),
    )


@dataclass(frozen=True, slots=True)
class PathPlan:
    """One destination of a dual send.

    Args:
        sender: the transport sender bound to that destination.
        grants: the destination's grant for each layer.
        ranges: the source ranges for each layer (``LayerPlans.src``).
    """

    sender: Sender
    grants: Sequence[Grant]
    ranges: Sequence[ByteRanges]


class _Path:
    def __init__(self, name: str, plan: PathPlan, num_layers: int) -> None:
        if len(plan.grants) != num_layers or len(plan.ranges) != num_layers:
            raise LocalProtocolError(
                f"path {name!r}: {len(plan.grants)} grants and {len(plan.ranges)} range sets "
                f"for {num_layers} layers"
            )
        self.name = name
        self.plan = plan
        self.transfers: list[Transfer | None] = [None] * num_layers
        self.started = [trio.Event() for _ in range(num_layers)]
        self.cancelled = False


class DualTransfer:
    """One request's KV to several destinations (RLD and MD), layer by layer.

    Args:
        views: P's KV buffers (the pool's host views).
        paths: destination name (e.g. ``"rld"``, ``"md"``) -> :class:`PathPlan`.
        num_layers: KV layers.
        priority: passed to every transfer.
        timeout: seconds each layer transfer may take once started.

    Raises:
        LocalProtocolError: if a path's grants or ranges do not cover every layer.
    """

    def __init__(
        self,
        views: Sequence[Any],
        paths: dict[str, PathPlan],
        num_layers: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
    ) -> None:
        self.views = list(views)
        self.num_layers = num_layers
        self.priority = priority
        self.timeout = timeout
        self._paths = {name: _Path(name, p, num_layers) for name, p in paths.items()}
        self._ready = [False] * num_layers

    @property
    def destinations(self) -> list[str]:
        return list(self._paths)

    def _path(self, dest: str) -> _Path:
        try:
            return self._paths[dest]
        except KeyError:
            raise LocalProtocolError(f"no destination {dest!r} in this dual send") from None

    def layer_ready(self, layer: int) -> None:
        """Prefill finished ``layer``: start sending it to every live destination.

        Raises:
            LocalProtocolError: for a layer out of range. A second call is a no-op.
        """
        if not 0 <= layer < self.num_layers:
            raise LocalProtocolError(f"layer {layer} outside [0, {self.num_layers})")
        if self._ready[layer]:
            return
        self._ready[layer] = True
        for path in self._paths.values():
            if not path.cancelled:
                plan = path.plan
                path.transfers[layer] = plan.sender.start(
                    plan.grants[layer],
                    self.views,
                    plan.ranges[layer],
                    priority=self.priority,
                    timeout=self.timeout,
                )
            path.started[layer].set()

    def all_ready(self) -> None:
        """Every layer is ready (the KV existed before the send)."""
        for layer in range(self.num_layers):
            self.layer_ready(layer)

    async def wait_layer(self, dest: str, layer: int) -> None:
        """Wait until ``dest`` confirmed every byte of ``layer``.

        Raises:
            TransferCancelled: if that destination was cancelled.
            TransportError and its kin: as the layer's transfer failed.

        Cancelling the wait leaves the transfer running.
        """
        path = self._path(dest)
        await path.started[layer].wait()
        t = path.transfers[layer]
        if t is None:
            raise TransferCancelled(f"destination {dest!r} was cancelled", peer=dest)
        await t.wait()

    async def wait(self, dest: str | None = None) -> None:
        """Wait for every layer of ``dest`` (or of every destination), in layer order."""
        for name in [dest] if dest is not None else list(self._paths):
            for layer in range(self.num_layers):
                await self.wait_layer(name, layer)

    def cancel(self, dest: str | None = None) -> None:
        """Cancel one destination (or all): its running layers stop, later ones never start."""
        for name in [dest] if dest is not None else list(self._paths):
            path = self._path(name)
            path.cancelled = True
            for t in path.transfers:
                if t is not None:
                    t.cancel()
            for layer, ev in enumerate(path.started):
                if not ev.is_set():
                    path.transfers[layer] = None
                    ev.set()

    def layer_states(self, dest: str) -> list[TransferState | None]:
        """Per layer: the transfer's state, or None if not started."""
        return [None if t is None else t.state for t in self._path(dest).transfers]

    def state(self, dest: str) -> TransferState:
        """DONE when every layer is, CANCELLED/FAILED if any is, else RUNNING."""
        path = self._path(dest)
        states = self.layer_states(dest)
        if path.cancelled:
            return TransferState.CANCELLED
        if any(s is TransferState.FAILED for s in states):
            return TransferState.FAILED
        if all(s is TransferState.DONE for s in states):
            return TransferState.DONE
        return TransferState.RUNNING

    async def run_to_end(self) -> dict[str, PddnetError | None]:
        """Wait for every destination independently; returns each one's error (or None)."""
        out: dict[str, PddnetError | None] = {}

        async def one(name: str) -> None:
            try:
                await self.wait(name)
                out[name] = None
            except PddnetError as exc:
                out[name] = exc

        async with trio.open_nursery() as n:
            for name in self._paths:
                n.start_soon(one, name)
        return out
