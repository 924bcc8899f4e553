"""The local path (P -> RLD inside a datacenter): UCX through ucxx.

:class:`UcxReceiver` pre-posts tagged receives straight into the granted KV
blocks; :class:`UcxSender` sends each coalesced range as one tagged message.
Both are driven from trio through the worker's epoll fd (see
:class:`UcxWorker` and docs/local.md).

:func:`open_local_receiver` / :func:`open_local_sender` pick UCX when ucxx is
importable and otherwise fall back to the TCP transport of
:mod:`pddnet.transport.wan`, logging one warning. :func:`probe_local_path`
checks, with one real transfer between two hosts, whether UCX works there.
"""

from ._fallback import local_available, open_local_receiver, open_local_sender
from ._probe import LocalPathProbe, probe_local_path
from ._receiver import UcxReceiver, UcxReceiverStatistics
from ._sender import UcxSender, UcxSenderStatistics
from ._tx_transfers import UcxTransfer
from ._worker import K_DEFAULT_TLS, UcxWorker, detects_dead_peers

__all__ = [
    "K_DEFAULT_TLS",
    "LocalPathProbe",
    "UcxReceiver",
    "UcxReceiverStatistics",
    "UcxSender",
    "UcxSenderStatistics",
    "UcxTransfer",
    "UcxWorker",
    "detects_dead_peers",
    "local_available",
    "open_local_receiver",
    "open_local_sender",
    "probe_local_path",
]
