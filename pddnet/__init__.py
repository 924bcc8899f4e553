"""pddnet: cross-datacenter prefill/decode handoff middleware.

Prefill (P) and RelayDecode (RLD) sit in one datacenter, MainDecode (MD) in
another. pddnet moves KV between them (a local UCX path and a multi-stream
WAN path), hands decoding over from RLD to MD by token ids, and recomputes the
eager tokens' KV on MD. See docs/architecture.md.

Optional extras are imported lazily: ``pddnet[ucx]`` (ucxx) and
``pddnet[gpu]`` (CuPy). ``import pddnet`` needs neither.
"""

from ._errors import (
    AuthError,
    LayoutMismatch,
    LocalProtocolError,
    MissingExtraError,
    PddnetError,
    PeerUnavailable,
    ProtocolError,
    RemoteCallError,
    RemoteProtocolError,
    RequestAborted,
    ResourceLimitError,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from .kv import KVLayout, KVPool, TransferPlan

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "KVLayout",
    "KVPool",
    "LayoutMismatch",
    "LocalProtocolError",
    "MissingExtraError",
    "PddnetError",
    "PeerUnavailable",
    "ProtocolError",
    "RemoteCallError",
    "RequestAborted",
    "RemoteProtocolError",
    "ResourceLimitError",
    "TransferCancelled",
    "TransferPlan",
    "TransferTimeout",
    "TransportError",
    "__version__",
]
