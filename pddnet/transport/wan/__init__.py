"""The WAN path: multi-stream TCP with chunking, striping, hedging, pacing and priority.

``WanReceiver`` grants destination memory and receives into it; ``WanSender``
keeps N persistent TCP streams to one receiver and schedules every transfer
to it over them. The scheduling, acceptance and pacing logic are sans-IO
(``Scheduler``, ``GrantTable``, ``Pacer``). Optional TLS (``TlsConfig``) and
the receiver's resource bounds (``WanLimits``). ``K_DEFAULT_CHUNK`` and
``K_DEFAULT_BUFFER`` are ``WanSender``'s default chunk size and socket buffer
size. See docs/wan.md for the design.
"""

from ._acceptor import GrantTable
from ._framing import LinkCode, LinkFrame, LinkKind
from ._io import native_path
from ._limits import WanLimitExceeded, WanLimits
from ._messages import WanCancel, WanGrant, WanGrantRequest
from ._pacer import (
    AdaptivePacer,
    FixedPacer,
    Pacer,
    PacingDecision,
    TcpSample,
    available_pacers,
    make_pacer,
    register_pacer,
)
from ._receiver import ReceiverStatistics, WanReceiver
from ._scheduler import Chunk, Scheduler, TransferCompleted, TransferFailed, TransferProgress
from ._sender import (
    K_DEFAULT_BUFFER,
    K_DEFAULT_CHUNK,
    SenderStatistics,
    StreamStatistics,
    WanSender,
    WanTransfer,
    default_streams,
    path_chunk_size,
)
from ._tls import TlsConfig

__all__ = [
    "AdaptivePacer",
    "Chunk",
    "FixedPacer",
    "GrantTable",
    "K_DEFAULT_BUFFER",
    "K_DEFAULT_CHUNK",
    "LinkCode",
    "LinkFrame",
    "LinkKind",
    "Pacer",
    "PacingDecision",
    "ReceiverStatistics",
    "Scheduler",
    "SenderStatistics",
    "StreamStatistics",
    "TcpSample",
    "TlsConfig",
    "TransferCompleted",
    "TransferFailed",
    "TransferProgress",
    "WanCancel",
    "WanGrant",
    "WanGrantRequest",
    "WanLimitExceeded",
    "WanLimits",
    "WanReceiver",
    "WanSender",
    "WanTransfer",
    "native_path",
    "available_pacers",
    "default_streams",
    "make_pacer",
    "path_chunk_size",
    "register_pacer",
]
