"""The drivers' :class:`~pddnet.handoff.TokenOut` on a decoder: each token to its sink.

A token is kept for the sink's re-sends before it is sent
(:class:`~pddnet.api._kept.KeptTokens`), so one whose send failed can still
be delivered. MD, taking over from RLD, first keeps the tokens of RLD's final
batch too: RLD may not have shown them all yet (its playout buffer,
``HandoffParams.playout_s``), or its last frames may be lost, and if RLD dies
then, MD is the only decoder that can fill the sink's hole. A sink that
cannot be reached stops the request: nobody can read its stream any more, and
the driver's normal exit frees its blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .._errors import PddnetError
from ..control import ControlNode
from ..handoff import MainDriver
from ._kept import KeptTokens
from ._messages import Emitted
from ._record import RequestRecord

__all__ = ["SinkEmitter"]

log = logging.getLogger("pddnet.api")


class SinkEmitter:
    """Sends the user's tokens to each request's sink.

    Args:
        node: the decoder's control node (the tokens go through it, named after it).
        kept: keeps each token for the sink's re-sends; its ``timeout_s``
            bounds each send.
        requests: the requests in progress, by id.
    """

    def __init__(
        self, node: ControlNode, kept: KeptTokens, requests: Mapping[int, RequestRecord]
    ) -> None:
        self.node = node
        self.kept = kept
        self.requests = requests
        self.emitted = 0  # tokens the sinks took
        self.sink_failures = 0  # requests stopped because their sink was unreachable

    async def emit(self, request_id: int, position: int, token: int, final: bool) -> None:
        """Send ``token`` at ``position`` of the request's stream to its sink.

        A send that fails is not raised: it counts in ``sink_failures`` and
        cancels the request's driver.
        """
        req = self.requests[request_id]
        msg = Emitted(request_id, position, token, self.node.name, final)
        driver = req.driver
        if isinstance(driver, MainDriver) and position and position == driver.machine.final_end:
            kept = self.kept.get(request_id)
            if kept is not None and kept.first < 0:  # MD's first token after RLD's
                for i, held in enumerate(driver.machine.received[:position]):
                    self.kept.record(request_id, i, held, False)
        self.kept.record(request_id, position, token, final)  # first: a re-send can deliver it
        try:
            await self.node.send(req.sink, msg, timeout=self.kept.timeout_s)
        except PddnetError as exc:
            self.sink_failures += 1
            log.warning(
                "%s: sink %s unreachable for %s: %s", self.node.name, req.sink, request_id, exc
            )
            if req.driver is not None:
                req.driver.cancel()
            return
        req.emitted += 1
        req.delivered_final = req.delivered_final or msg.finished
        self.emitted += 1
