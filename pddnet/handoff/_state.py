"""States and transition tables of the RLD and MD handoff machines.

Theory of operation
===================

A request on the P->RLD->MD route is decoded by two instances in turn. RLD, in
the prefill datacenter, starts decoding as soon as P's KV reaches it over the
local fast path, and streams *eager* tokens to the user while the same KV
crawls over the WAN to MD. When MD holds the prompt KV it says so
(``KvReady``). RLD then hands the request over *by token ids*: it sends the
ids it generated (``TokenBatch``), MD recomputes their KV in one extend pass
and acknowledges the position it reached (``HandoffAck``). The last batch is
marked ``final``: RLD stops emitting at its end, and MD, once it has
recomputed up to there, takes over and emits from that position on.

Each side is a sans-IO machine: :class:`~pddnet.handoff.RelayHandoff` (RLD)
and :class:`~pddnet.handoff.MainHandoff` (MD). They consume events (a token
was generated, a message arrived, a timer fired, the peer failed) together
with ``now``, and return outputs (emit this token, send this message, cancel
the WAN transfer, run this recompute, take over). Every state change goes
through the tables below; an event a table does not list for the current
state is a :class:`~pddnet.LocalProtocolError`, and the machine then enters
``ERROR``, which is sticky. Events that come from the network (messages,
timers, failures) are listed for every state, because the network may
duplicate, delay or reorder them; in states where they are stale their edge
is "ignore" (or a re-send that makes a lost message recoverable). Events from
the local engine (a token, a finished recompute) are listed only where the
engine may legitimately produce them, so a driver bug fails loudly.

Modes. In *one-shot* mode RLD sends everything it generated as one final
batch as soon as MD's KV lands: RLD is released quickly, the user sees one
stall of about ``pending / recompute_rate + rtt``. In *catch-up* mode, if
more than ``catchup_threshold`` tokens are pending, RLD sends them as a
non-final batch and keeps decoding; each ack releases the tokens generated
meanwhile as the next batch. The rounds shrink as long as MD recomputes
faster than RLD decodes. Once at most ``final_switch_size`` tokens are
unsent, RLD sends them as the final batch: one large stall becomes a few
imperceptible ones.

Invariants, and why they hold.

1. *The user's stream is the model's sequence: every token once, in order,
   no gaps.* Positions are assigned by the machine that emits, from a counter
   that only advances by one per emitted token. RLD emits positions
   ``0..final_end-1`` and, once it has sent the final batch (it sends the
   final batch, and changes state, in the same step), only those of them it
   still holds for the playout (below): it holds tokens it decoded, in order,
   and shows them in that order before any later one. MD emits only after
   :class:`TakeOver`, starting at ``final_end``, which is the end of the final
   batch it received and recomputed. Batches carry absolute positions; MD
   appends a batch only where it is contiguous with what it holds, stashes
   batches that arrive early, treats repeats as duplicates, and rejects a
   batch that contradicts tokens it already holds (RemoteProtocolError).

2. *Exactly one owner emits at any time.* RLD may emit in ``DECODING``,
   ``CATCHING_UP`` and ``SOLO``; MD only in ``OWNER``. MD reaches ``OWNER``
   only after receiving a ``final`` batch, which RLD sends only on its way
   into ``SWITCHING``, where it does not emit. RLD leaves ``SWITCHING`` back
   into emitting (``SOLO``) only if MD says it will not take over (an abort)
   or MD died and the user's stream shows that MD emitted nothing
   (``PeerFailed.user_position == final_end``). MD leaves ``OWNER`` only to a
   terminal state. During the switch no one emits: that gap is the stall.
   With a playout buffer (``playout_s > 0``) RLD may still show, in
   ``SWITCHING``, tokens it decoded before the final batch, all below
   ``final_end``, while MD emits from ``final_end``: each *position* still
   has one owner. RLD shows whatever it still holds when it leaves
   ``SWITCHING`` (released, resumed, failed) and drops it when the request
   is cancelled.

3. *RLD is released after a bounded number of rounds.* Every batch counts
   as a round (retransmissions do not), and ``max_rounds`` includes the final
   switch: before sending a non-final batch that would leave no round for
   the final one, RLD falls back instead.

4. *No oscillation.* RLD's states are ordered DECODING < CATCHING_UP <
   SWITCHING < SOLO < terminal, and no edge goes backwards: once catch-up is
   abandoned (rounds ran out, a round did not shrink the backlog by
   ``min_shrink``, or the recompute-rate estimate predicts no convergence)
   RLD either hands everything over at once (one-shot fallback) or keeps the
   request to completion (``SOLO``). It never re-enters catch-up.

5. *Tiny tail chunks are merged.* At most one batch is in flight; tokens
   generated meanwhile accumulate and go as one batch. A non-final batch
   never carries fewer than ``min_batch`` tokens: a smaller remainder waits
   for more tokens or rides in the final switch. MD likewise recomputes
   everything it holds in one extend pass.

Playout. While MD may yet take over, RLD can show each token a little after
decoding it (``playout_s``; the delay ramps up by half a decode interval per
token and P's first token is never held). When it sends the final batch it
spreads what it holds evenly up to MD's predicted first token, so the switch
stall is cut into gaps of about ``stall / (held + 1)``. Batches carry every
decoded token, held or not: MD's timing does not change.

Failures. Every wait has a deadline (KV landing, acks with retransmission,
MD's idle wait for batches, a recompute); see the failure table in
docs/handoff.md. MD dying before it owns the request leaves RLD decoding to
completion. RLD dying leaves MD to continue only from a position it holds
that equals the user's stream position (the final batch's end, or a
``user_position`` the stream's sink reports); otherwise MD fails the request
with :class:`~pddnet.PeerUnavailable`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ._events import (
    BatchAcked,
    BatchReceived,
    Cancel,
    Event,
    KvLanded,
    PeerAborted,
    PeerFailed,
    RecomputeDone,
    RequestFinished,
    Timer,
    TokenGenerated,
)

__all__ = ["MAIN_TABLE", "RELAY_TABLE", "MainState", "RelayState", "Table"]


class RelayState(enum.Enum):
    """States of the RLD side."""

    DECODING = enum.auto()  # eager decoding, MD's KV still in flight
    CATCHING_UP = enum.auto()  # handing over in rounds while still decoding
    SWITCHING = enum.auto()  # final batch sent; RLD no longer emits
    SOLO = enum.auto()  # handoff abandoned; RLD decodes to completion
    RELEASED = enum.auto()  # MD owns the request; RLD is free
    FINISHED = enum.auto()  # RLD finished the request itself
    CANCELLED = enum.auto()
    FAILED = enum.auto()  # the request failed with a typed error
    ERROR = enum.auto()  # protocol violation; sticky


class MainState(enum.Enum):
    """States of the MD side."""

    WAITING_KV = enum.auto()  # the WAN transfer is in flight
    READY = enum.auto()  # KV landed; waiting for token batches
    RECOMPUTING = enum.auto()  # one extend pass in flight
    OWNER = enum.auto()  # MD decodes and emits
    FINISHED = enum.auto()
    ABORTED = enum.auto()  # handoff abandoned; blocks freed, RLD keeps the request
    CANCELLED = enum.auto()
    FAILED = enum.auto()
    ERROR = enum.auto()


Table = Mapping[tuple[enum.Enum, type[Event]], Mapping[str, enum.Enum]]
"""``{(state, event type): {outcome label: next state}}``. The handler of the
event picks the outcome; the table alone decides the next state."""

R = RelayState
M = MainState

_R_TERMINAL = (R.RELEASED, R.FINISHED, R.CANCELLED, R.FAILED)
_M_TERMINAL = (M.FINISHED, M.ABORTED, M.CANCELLED, M.FAILED)

_CATCHUP_STEP = {
    "next round": R.CATCHING_UP,
    "final switch": R.SWITCHING,
    "fallback one-shot": R.SWITCHING,
    "fallback keep": R.SOLO,
}

_Edges = dict[tuple[enum.Enum, type[Event]], Mapping[str, enum.Enum]]

RELAY_TABLE: _Edges = {
    # DECODING: eager tokens flow to the user; the WAN transfer is in flight.
    (R.DECODING, TokenGenerated): {"emit": R.DECODING, "finished": R.FINISHED},
    (R.DECODING, RequestFinished): {"finished": R.FINISHED},
    (R.DECODING, KvLanded): {
        "one-shot": R.SWITCHING,
        "catch up": R.CATCHING_UP,
        "fallback one-shot": R.SWITCHING,
        "fallback keep": R.SOLO,
    },
    (R.DECODING, BatchAcked): {"ignore": R.DECODING},
    (R.DECODING, PeerAborted): {"keep": R.SOLO, "cancelled": R.CANCELLED},
    (R.DECODING, PeerFailed): {"keep": R.SOLO},
    (R.DECODING, Timer): {"wait": R.DECODING, "show": R.DECODING, "kv timeout": R.SOLO},
    (R.DECODING, Cancel): {"cancelled": R.CANCELLED},
    # CATCHING_UP: at most one batch in flight; RLD still emits.
    (R.CATCHING_UP, TokenGenerated): {"emit": R.CATCHING_UP, "finished": R.FINISHED}
    | _CATCHUP_STEP,
    (R.CATCHING_UP, RequestFinished): {"finished": R.FINISHED},
    (R.CATCHING_UP, KvLanded): {"ignore": R.CATCHING_UP},
    (R.CATCHING_UP, BatchAcked): {"wait": R.CATCHING_UP} | _CATCHUP_STEP,
    (R.CATCHING_UP, PeerAborted): {"keep": R.SOLO, "cancelled": R.CANCELLED},
    (R.CATCHING_UP, PeerFailed): {"keep": R.SOLO},
    (R.CATCHING_UP, Timer): {
        "wait": R.CATCHING_UP,
        "show": R.CATCHING_UP,
        "retransmit": R.CATCHING_UP,
        "ack timeout": R.SOLO,
    },
    (R.CATCHING_UP, Cancel): {"cancelled": R.CANCELLED},
    # SWITCHING: the final batch is out; RLD emits only the tokens it held (playout).
    (R.SWITCHING, KvLanded): {"ignore": R.SWITCHING},
    (R.SWITCHING, BatchAcked): {"wait": R.SWITCHING, "released": R.RELEASED},
    (R.SWITCHING, PeerAborted): {"resume": R.SOLO, "cancelled": R.CANCELLED},
    (R.SWITCHING, PeerFailed): {"resume": R.SOLO, "failed": R.FAILED},
    (R.SWITCHING, Timer): {
        "wait": R.SWITCHING,
        "show": R.SWITCHING,
        "retransmit": R.SWITCHING,
        "ack timeout": R.FAILED,
    },
    (R.SWITCHING, Cancel): {"cancelled": R.CANCELLED},
    # SOLO: RLD keeps the request to completion; MD has been told to let go.
    (R.SOLO, TokenGenerated): {"emit": R.SOLO, "finished": R.FINISHED},
    (R.SOLO, RequestFinished): {"finished": R.FINISHED},
    (R.SOLO, KvLanded): {"re-abort": R.SOLO, "ignore": R.SOLO},
    (R.SOLO, BatchAcked): {"ignore": R.SOLO},
    (R.SOLO, PeerAborted): {"ignore": R.SOLO},
    (R.SOLO, PeerFailed): {"ignore": R.SOLO},
    (R.SOLO, Timer): {"ignore": R.SOLO},
    (R.SOLO, Cancel): {"cancelled": R.CANCELLED},
}
for _s in _R_TERMINAL:
    RELAY_TABLE[_s, KvLanded] = {"re-abort": _s, "ignore": _s}
    for _ev in (BatchAcked, PeerAborted, PeerFailed, Timer, Cancel):
        RELAY_TABLE[_s, _ev] = {"ignore": _s}

_TO_RECOMPUTE = {"recompute": M.RECOMPUTING, "take over": M.OWNER}

MAIN_TABLE: _Edges = {
    # WAITING_KV: the prompt KV is on the WAN; early batches are buffered.
    (M.WAITING_KV, KvLanded): {"ready": M.READY} | _TO_RECOMPUTE,
    (M.WAITING_KV, BatchReceived): {"buffer": M.WAITING_KV},
    (M.WAITING_KV, PeerAborted): {"aborted": M.ABORTED, "cancelled": M.CANCELLED},
    (M.WAITING_KV, PeerFailed): {"continue": M.WAITING_KV, "failed": M.FAILED},
    (M.WAITING_KV, Timer): {
        "wait": M.WAITING_KV,
        "kv timeout": M.ABORTED,
        "failed": M.FAILED,
    },
    (M.WAITING_KV, Cancel): {"cancelled": M.CANCELLED},
    # READY: KV landed, nothing to recompute yet.
    (M.READY, BatchReceived): {"buffer": M.READY} | _TO_RECOMPUTE,
    (M.READY, PeerAborted): {"aborted": M.ABORTED, "cancelled": M.CANCELLED},
    (M.READY, PeerFailed): {"continue": M.READY, "failed": M.FAILED} | _TO_RECOMPUTE,
    (M.READY, Timer): {
        "wait": M.READY,
        "retransmit": M.READY,
        "idle timeout": M.ABORTED,
        "failed": M.FAILED,
    },
    (M.READY, Cancel): {"cancelled": M.CANCELLED},
    # RECOMPUTING: one extend pass in flight; new batches are buffered.
    (M.RECOMPUTING, BatchReceived): {"buffer": M.RECOMPUTING},
    (M.RECOMPUTING, RecomputeDone): {"ready": M.READY} | _TO_RECOMPUTE,
    (M.RECOMPUTING, PeerAborted): {"aborted": M.ABORTED, "cancelled": M.CANCELLED},
    (M.RECOMPUTING, PeerFailed): {"continue": M.RECOMPUTING, "failed": M.FAILED},
    (M.RECOMPUTING, Timer): {
        "wait": M.RECOMPUTING,
        "recompute timeout": M.ABORTED,
        "failed": M.FAILED,
    },
    (M.RECOMPUTING, Cancel): {"cancelled": M.CANCELLED},
    # OWNER: MD decodes and emits.
    (M.OWNER, TokenGenerated): {"emit": M.OWNER, "finished": M.FINISHED},
    (M.OWNER, RequestFinished): {"finished": M.FINISHED},
    (M.OWNER, BatchReceived): {"re-ack": M.OWNER},
    (M.OWNER, PeerAborted): {"cancelled": M.CANCELLED},
    (M.OWNER, PeerFailed): {"ignore": M.OWNER},
    (M.OWNER, Timer): {"ignore": M.OWNER},
    (M.OWNER, Cancel): {"cancelled": M.CANCELLED},
}
for _m in _M_TERMINAL:
    MAIN_TABLE[_m, BatchReceived] = {"re-abort": _m, "re-ack": _m, "ignore": _m}
    for _mev in (KvLanded, RecomputeDone, PeerAborted, PeerFailed, Timer, Cancel):
        MAIN_TABLE[_m, _mev] = {"ignore": _m}

TERMINAL: frozenset[enum.Enum] = frozenset(_R_TERMINAL + _M_TERMINAL)
"""States in which a machine is done; entering one produces a ``Done`` output."""
