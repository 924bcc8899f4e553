"""Admission on a decoder: P's ``KvOffer`` becomes a request in progress.

An offer is checked (a new request id, room for one more request, a sane
prompt and ``max_tokens``), its blocks are reserved and the prompt's granted
to the data-path receiver (:class:`~pddnet.api._grants.BlockGrants`), and
the request is opened (:class:`~pddnet.api._requests.DecodeRequests`). The
answer to P is the ``KvAccept`` that carries the grant. Nothing is reserved
for an offer that is refused.
"""

from __future__ import annotations

import dataclasses

from .._errors import PddnetError, RemoteProtocolError, ResourceLimitError
from ..handoff import HandoffParams
from ..wire import decode_tokens
from ._grants import BlockGrants
from ._messages import KvAccept, KvOffer
from ._record import RequestRecord
from ._requests import DecodeRequests

__all__ = ["K_MAX_PROMPT", "Admission"]

K_MAX_PROMPT = 1 << 20  # prompt tokens and max_tokens of one request, at most


class Admission:
    """Checks P's offers and opens the requests they start.

    Args:
        requests: the requests in progress (an admitted one is opened there).
        grants: reserves and grants the request's blocks.
        params: the decoder's handoff parameters (a request's deadline caps its waits).
        max_requests: requests in progress at most; a further offer is refused.
    """

    def __init__(
        self,
        requests: DecodeRequests,
        grants: BlockGrants,
        params: HandoffParams,
        *,
        max_requests: int,
    ) -> None:
        self.requests = requests
        self.grants = grants
        self.params = params
        self.max_requests = max_requests
        self.offers = 0
        self.rejected = 0  # offers refused for want of room (requests or blocks)

    def admit(self, peer: str, msg: KvOffer) -> tuple[RequestRecord, KvAccept]:
        """Open the request ``msg`` offers.

        Returns:
            The request, opened, and the answer to P.

        Raises:
            RemoteProtocolError: a request id in progress, a bad ``max_tokens``,
                an empty or malformed prompt.
            ResourceLimitError: ``max_requests`` requests are in progress, or
                too few blocks are free.
            PddnetError: the receiver refused the grant (its own bounds).
        """
        self.offers += 1
        requests = self.requests
        if msg.request_id in requests:
            raise RemoteProtocolError("duplicate request id", peer=peer, request_id=msg.request_id)
        if len(requests) >= self.max_requests:
            self.rejected += 1
            raise ResourceLimitError(
                f"{len(requests)} requests in progress (max_requests={self.max_requests})",
                peer=peer,
                request_id=msg.request_id,
            )
        if not 0 < msg.max_tokens <= K_MAX_PROMPT:
            raise RemoteProtocolError("bad max_tokens", peer=peer, request_id=msg.request_id)
        prompt = decode_tokens(msg.prompt, K_MAX_PROMPT)
        if prompt.size == 0:
            raise RemoteProtocolError("empty prompt", peer=peer, request_id=msg.request_id)
        req = RequestRecord(
            msg.request_id,
            prompt,
            msg.offered_first_token(),
            msg.max_tokens,
            peer,
            msg.relay,
            msg.main,
            msg.sink,
            self.params_for(msg.deadline_s),
        )
        try:
            grant, skip = self.grants.reserve(req)
        except PddnetError:
            self.rejected += 1
            raise
        requests.open(req)
        accept = KvAccept(
            req.rid,
            grant.transfer_id,
            grant.total,
            list(grant.layer_ends),
            grant.address,
            skip,
            self.grants.lease_s,
        )
        return req, accept

    def params_for(self, deadline_s: float) -> HandoffParams:
        """The decoder's handoff parameters, with waits capped by the request's deadline."""
        if not deadline_s > 0:
            return self.params
        return dataclasses.replace(
            self.params,
            kv_timeout_s=min(self.params.kv_timeout_s, deadline_s),
            idle_timeout_s=min(self.params.idle_timeout_s, deadline_s / 2),
        )
