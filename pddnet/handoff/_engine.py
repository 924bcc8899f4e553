"""The one contract between pddnet and a decode engine (RLD or MD).

pddnet never runs a model and never asks for one step: it tells the engine
"this request's KV is in these blocks, its tokens so far are these; continue
it" (:meth:`DecodeEngine.run`) and consumes the tokens the engine produces,
until the request finishes or pddnet says "stop it" (:meth:`DecodeEngine.stop`).
The engine owns its step loop and may batch every running request into one
step; it computes the tokens whose KV is missing (``tokens[kv_tokens:]``) in
one extend pass on its own, so MD's recompute of RLD's eager tokens is only
a continue with a longer prefix.

The contract lives in the handoff package because the drivers consume it;
:mod:`pddnet.api` exports the same names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._errors import LocalProtocolError
from ._events import FinishReason

__all__ = ["DecodeEngine", "DecodeRequest", "TokenCallback"]

TokenCallback = Callable[[int, "FinishReason | None"], None]
"""Called by the engine with each new token, in order, and the reason when it
ends the request (EOS, max tokens). Never blocks; call it from the event loop."""


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """What :meth:`DecodeEngine.run` continues.

    Attributes:
        request_id: the request.
        tokens: the prompt, then the user's tokens so far (at least one
            more than ``kv_tokens``: the engine needs the last token's logits).
        kv_tokens: the KV of ``tokens[:kv_tokens]`` is already in ``block_table``
            (the prompt's, landed; or what an earlier run of this request wrote).
        block_table: the request's KV blocks, in order (pddnet allocated them
            through :meth:`DecodeEngine.allocate` and frees them itself).
        max_new_tokens: the engine produces at most this many tokens; the
            last one carries ``FinishReason.MAX_TOKENS``.

    Raises:
        LocalProtocolError: if no token lacks KV, or no token is asked for.
    """

    request_id: int
    tokens: tuple[int, ...]
    kv_tokens: int
    block_table: tuple[int, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.kv_tokens < len(self.tokens) or self.max_new_tokens < 1:
            raise LocalProtocolError(
                f"continue {len(self.tokens)} tokens with KV for {self.kv_tokens},"
                f" {self.max_new_tokens} new",
                request_id=self.request_id,
            )


class DecodeEngine(Protocol):
    """What a decode instance (RLD or MD) provides to pddnet.

    Block ids index the :class:`~pddnet.KVPool` the endpoint was given. The
    synchronous methods are called from pddnet's event loop and must not
    block it; :meth:`run` is where the engine waits.
    """

    eos_token_id: int | None

    def allocate(self, num_blocks: int) -> Sequence[int]:
        """Reserve ``num_blocks`` free KV blocks, at once.

        Raises:
            ResourceLimitError: if the pool has too few free blocks.
        """
        ...

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks to the engine's free list."""
        ...

    def free_blocks(self) -> int:
        """How many blocks :meth:`allocate` could hand out now. MD evicts
        exactly the shortfall from its radix cache before allocating."""
        ...

    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        """Continue ``request``: compute the KV of ``tokens[kv_tokens:]`` (one
        extend pass when that is more than one token), then keep decoding,
        calling ``on_token`` with each new token, until the request finishes
        (EOS or ``max_new_tokens``; the last token carries the reason) or
        :meth:`stop` is called. The engine decides when steps happen and may
        step many requests together.

        At most one run per request is in progress at a time.

        Cancellation: as :meth:`stop`. Either way, ``run`` returns only when
        the engine no longer reads or writes the request's blocks, so pddnet
        may free or reuse them then.
        """
        ...

    def stop(self, request_id: int) -> None:
        """End the request's :meth:`run` soon; no further ``on_token`` calls
        (never blocks; a no-op when it is not running)."""
        ...
