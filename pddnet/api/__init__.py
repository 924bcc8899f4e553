"""The engine-facing API: three roles an inference engine embeds.

* :class:`PrefillEndpoint` (P): after prefill, :meth:`~PrefillEndpoint.submit`
  routes the request and ships its KV (every block to RLD, the DRC delta to MD).
* :class:`RelayEndpoint` (RLD): decodes eager tokens while MD's KV is in
  flight, then hands over by token ids.
* :class:`MainEndpoint` (MD): receives the delta, recomputes RLD's tokens,
  takes over decoding.

Each is a trio async context manager; :class:`SyncEndpoint` runs any of them
on its own thread for engines with synchronous schedulers (``submit``,
``poll``, a wake-up fd). Decode engines implement :class:`DecodeEngine`
(continue a request, stream its tokens, stop it; batched as the engine
likes); :class:`ReferenceEngine` does so with pddnet's reference model. A
:class:`TokenSink` (P's node has one) turns the decoders' token frames into
complete, ordered streams or typed errors. See docs/embedding.md.
"""

from ._decode import DecodeStatistics, MainEndpoint, RelayEndpoint, new_request_id, stats_payload
from ._engine import DecodeEngine, DecodeRequest, ReferenceEngine, TokenCallback
from ._info import EndpointInfo, Rendezvous
from ._lease import Lease, LeaseTable
from ._messages import (
    Abort,
    CutOffWan,
    Emitted,
    KvAccept,
    KvOffer,
    LeaseRenew,
    StatsReply,
    StatsRequest,
    StreamAck,
    StreamResend,
    StreamStatus,
    StreamTakeover,
)
from ._prefill import BlocksReleased, PrefillEndpoint, PrefillStatistics, Submission
from ._sink import SinkStatistics, StreamToken, TokenSink, TokenStream
from ._stream import SourceState, StreamAssembler, StreamPhase, StreamReport
from ._sync import Completion, SyncEndpoint

__all__ = [
    "Abort",
    "BlocksReleased",
    "Completion",
    "CutOffWan",
    "DecodeEngine",
    "DecodeRequest",
    "DecodeStatistics",
    "Emitted",
    "EndpointInfo",
    "KvAccept",
    "KvOffer",
    "Lease",
    "LeaseRenew",
    "LeaseTable",
    "MainEndpoint",
    "PrefillEndpoint",
    "PrefillStatistics",
    "ReferenceEngine",
    "RelayEndpoint",
    "Rendezvous",
    "SinkStatistics",
    "SourceState",
    "StatsReply",
    "StatsRequest",
    "StreamAck",
    "StreamAssembler",
    "StreamPhase",
    "StreamReport",
    "StreamResend",
    "StreamStatus",
    "StreamTakeover",
    "StreamToken",
    "Submission",
    "SyncEndpoint",
    "TokenCallback",
    "TokenSink",
    "TokenStream",
    "new_request_id",
    "stats_payload",
]
