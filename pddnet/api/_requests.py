"""The requests in progress on one decoder (RLD or MD), from admission to their end.

Opening a request registers it everywhere it is looked up while it runs:
here, with the tokens kept for its sink (:class:`~pddnet.api._kept.KeptTokens`)
and with the handoff hub (which holds the peer's early messages). Closing it
undoes that in one place, whatever ended it: the machine's statistics are
kept, the stream is kept a while for the sink's re-sends, and the blocks are
freed (MD caches a landed prompt's).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Mapping
from typing import TypeVar

import trio

from .._errors import PddnetError
from ..handoff import HandoffHub, MainDriver, MainStats, RelayDriver, RelayStats
from ._grants import BlockGrants
from ._kept import KeptTokens
from ._record import RequestRecord
from ._stream import SourceState

__all__ = ["K_HANDOFF_HISTORY", "DecodeRequests"]

log = logging.getLogger("pddnet.api")
_D = TypeVar("_D", RelayDriver, MainDriver)

K_HANDOFF_HISTORY = 4096  # ended requests whose handoff statistics are kept


class DecodeRequests(Mapping[int, RequestRecord]):
    """The requests one decoder serves now, by request id.

    Args:
        name: the decoder's name (for logs).
        grants: frees a request's blocks when it ends.
        kept: the tokens kept for the sinks' re-sends.
        hub: routes the peer's handoff messages to the requests' drivers.
    """

    def __init__(self, name: str, grants: BlockGrants, kept: KeptTokens, hub: HandoffHub) -> None:
        self.name = name
        self.grants = grants
        self.kept = kept
        self.hub = hub
        self.finished = 0  # requests that ended without an error
        self.failed = 0
        self.handoff_stats: collections.deque[RelayStats | MainStats] = collections.deque(
            maxlen=K_HANDOFF_HISTORY
        )
        self._reqs: dict[int, RequestRecord] = {}

    def __getitem__(self, request_id: int) -> RequestRecord:
        return self._reqs[request_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def open(self, req: RequestRecord) -> None:
        """``req`` starts here: keep its tokens for its sink, and hold the
        peer's messages for it until its driver is attached."""
        self._reqs[req.rid] = req
        self.kept.open(req.rid, req.sink)
        self.hub.expect(req.rid)

    def attach(self, req: RequestRecord, driver: _D) -> _D:
        """``driver`` runs ``req``: the peer's messages for it go to the driver."""
        req.driver = driver
        self.hub.attach(driver)
        return driver

    def close(self, req: RequestRecord, error: PddnetError | None) -> None:
        """``req`` ended (``error`` set if it failed): forget it, keep its
        stream a while for the sink's re-sends, free its blocks."""
        if req.driver is not None:
            self.handoff_stats.append(req.driver.machine.statistics(trio.current_time()))
        self._reqs.pop(req.rid, None)
        self.kept.end(req.rid, SourceState.DONE)
        self.hub.detach(req.rid)
        self.grants.free(req)
        if error is None:
            self.finished += 1
        else:
            self.failed += 1
            log.info("%s: request %s failed: %s", self.name, req.rid, error)
