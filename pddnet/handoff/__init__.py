"""Handoff from RelayDecode (RLD) to MainDecode (MD) by token ids.

Sans-IO machines for both sides (:class:`RelayHandoff`, :class:`MainHandoff`),
written as transition tables (``RELAY_TABLE``, ``MAIN_TABLE``), their events,
outputs and messages, per-request metrics, renderers that turn the tables
into the diagram in docs/handoff.md, and trio drivers (:class:`RelayDriver`,
:class:`MainDriver`) that connect the machines to a :class:`DecodeEngine`
(the one engine contract: continue a request, consume its tokens, stop it) and, through
:class:`HandoffHub`, to the control plane. The theory of operation is the docstring
of ``pddnet/handoff/_state.py``.
"""

from ._diagram import render_markdown, render_mermaid
from ._driver import HandoffDriver, HandoffRequest, Link, MainDriver, RelayDriver, TokenOut
from ._engine import DecodeEngine, DecodeRequest, TokenCallback
from ._events import (
    AbortReason,
    BatchAcked,
    BatchReceived,
    Cancel,
    CancelTransfer,
    Done,
    Emit,
    Event,
    FinishReason,
    FreeBlocks,
    KvLanded,
    Output,
    PeerAborted,
    PeerFailed,
    RecomputeDone,
    RequestFinished,
    SendMessage,
    StartRecompute,
    TakeOver,
    Timer,
    TokenGenerated,
)
from ._hub import ControlLink, HandoffHub
from ._machine import HandoffMachine
from ._main import K_MAX_STASHED_BATCHES, MainHandoff, MainStats
from ._messages import (
    FirstToken,
    HandoffAbort,
    HandoffAck,
    KvReady,
    TokenBatch,
    event_for_message,
    request_id_of,
)
from ._metrics import RequestMetrics, combine_metrics
from ._params import Fallback, HandoffMode, HandoffParams
from ._relay import RelayHandoff, RelayStats
from ._standin import StandInEngine, greedy_reference, standin_request
from ._state import MAIN_TABLE, RELAY_TABLE, MainState, RelayState

__all__ = [
    "K_MAX_STASHED_BATCHES",
    "MAIN_TABLE",
    "RELAY_TABLE",
    "AbortReason",
    "BatchAcked",
    "BatchReceived",
    "Cancel",
    "CancelTransfer",
    "ControlLink",
    "DecodeEngine",
    "DecodeRequest",
    "Done",
    "Emit",
    "Event",
    "Fallback",
    "FinishReason",
    "FirstToken",
    "FreeBlocks",
    "HandoffAbort",
    "HandoffAck",
    "HandoffDriver",
    "HandoffHub",
    "HandoffMachine",
    "HandoffMode",
    "HandoffRequest",
    "HandoffParams",
    "KvLanded",
    "KvReady",
    "Link",
    "MainDriver",
    "MainHandoff",
    "MainState",
    "MainStats",
    "Output",
    "PeerAborted",
    "PeerFailed",
    "RecomputeDone",
    "RelayDriver",
    "RelayHandoff",
    "RelayState",
    "RelayStats",
    "RequestFinished",
    "RequestMetrics",
    "SendMessage",
    "StandInEngine",
    "StartRecompute",
    "TakeOver",
    "Timer",
    "TokenCallback",
    "TokenBatch",
    "TokenGenerated",
    "TokenOut",
    "combine_metrics",
    "event_for_message",
    "greedy_reference",
    "render_markdown",
    "render_mermaid",
    "request_id_of",
    "standin_request",
]
