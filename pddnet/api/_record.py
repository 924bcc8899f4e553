"""One request on a decode endpoint (RLD or MD): what P offered, where its KV
goes, and how far its stream got."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import trio

from ..handoff import HandoffParams, HandoffRequest, MainDriver, RelayDriver

__all__ = ["RequestRecord"]


@dataclass
class RequestRecord:
    """A request on a decode endpoint, from P's ``KvOffer`` to its end."""

    rid: int
    prompt: np.ndarray
    first_token: int | None  # None: P's FirstToken follows
    max_tokens: int
    p: str  # the prefill peer
    relay: str
    main: str
    sink: str
    params: HandoffParams = field(default_factory=HandoffParams)
    table: list[int] = field(default_factory=list)
    owned: list[int] = field(default_factory=list)  # blocks it allocated (the rest: cache hits)
    transfer_id: int = 0
    plan_id: int | None = None
    driver: RelayDriver | MainDriver | None = None
    landed: trio.Event = field(default_factory=trio.Event)
    keep: bool = False  # strange traffic, but the transfer goes on to feed the cache
    delivered_final: bool = False  # the sink got this request's last token from us
    emitted: int = 0
    reported_at: int = -1  # (MD) the user position of the last takeover report acted on

    def handoff_request(self) -> HandoffRequest:
        """What the handoff driver runs on the engine."""
        return HandoffRequest(
            self.rid,
            tuple(self.prompt.tolist()),
            tuple(self.table),
            self.max_tokens,
            self.first_token,
        )
