"""The hooks a decode engine gives pddnet, and the reference model behind them.

pddnet never runs a model itself: it calls the engine's hooks. A decode
instance (RLD or MD) implements :class:`DecodeEngine`; pddnet decides when to
decode, hand over, recompute and stop. :class:`ReferenceEngine` implements the
hooks with :class:`~pddnet.recompute.ReferenceModel` and is the worked
example of docs/embedding.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .._errors import LocalProtocolError
from ..recompute import PagedSequence, ReferenceModel, greedy

__all__ = ["DecodeEngine", "ReferenceEngine"]


class DecodeEngine(Protocol):
    """What a decode instance (RLD or MD) provides. Calls come from pddnet's
    event loop and should return quickly (one decode step is fine).

    Block ids index the :class:`~pddnet.KVPool` the endpoint was given.
    """

    eos_token_id: int | None

    def allocate(self, num_blocks: int) -> Sequence[int]:
        """Reserve ``num_blocks`` free KV blocks.

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

    def start(
        self, request_id: int, prompt: Sequence[int], block_table: Sequence[int], first_token: int
    ) -> None:
        """The prompt's KV now fills ``block_table``; the first :meth:`decode_step`
        must return ``first_token`` (the token P's prefill produced)."""
        ...

    def decode_step(self, request_id: int) -> int:
        """Feed the last token and return the next one (greedy or sampled)."""
        ...

    def extend(self, request_id: int, tokens: Sequence[int]) -> None:
        """(MD) Compute the KV of ``tokens`` after what the request holds, in one
        pass; the next :meth:`decode_step` returns the token that follows them."""
        ...

    def finish(self, request_id: int) -> None:
        """Drop the request's state; pddnet frees its blocks itself."""
        ...


@dataclass
class _Seq:
    seq: PagedSequence
    ready: int | None  # the next token, already known (P's first token, or after an extend)
    last: int = -1  # the last token returned, fed on the next step


class ReferenceEngine:
    """:class:`DecodeEngine` over the reference model (greedy decoding).

    Args:
        model: the model; its pool is the endpoint's pool.
        eos_token_id: token that ends a request, or None.
    """

    def __init__(self, model: ReferenceModel, eos_token_id: int | None = None) -> None:
        if model.allocator is None:
            raise LocalProtocolError("the reference engine needs a model with a block allocator")
        self.model = model
        self.allocator = model.allocator
        self.eos_token_id = eos_token_id
        self._reqs: dict[int, _Seq] = {}

    @property
    def pool(self) -> Any:
        return self.model.pool

    def allocate(self, num_blocks: int) -> Sequence[int]:
        return [int(b) for b in self.allocator.allocate(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        self.allocator.free(np.asarray(block_ids, dtype=np.int32))

    def free_blocks(self) -> int:
        return int(self.allocator.free_blocks)

    def start(
        self, request_id: int, prompt: Sequence[int], block_table: Sequence[int], first_token: int
    ) -> None:
        table = np.asarray(block_table, dtype=np.int32)
        self._reqs[request_id] = _Seq(PagedSequence(table, len(prompt)), first_token)

    def _get(self, request_id: int) -> _Seq:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise LocalProtocolError("unknown request", request_id=request_id) from None

    def decode_step(self, request_id: int) -> int:
        st = self._get(request_id)
        if st.ready is not None:
            tok, st.ready = st.ready, None
        else:
            tok = greedy(self.model.decode_step(st.seq, st.last))
        st.last = tok
        return tok

    def extend(self, request_id: int, tokens: Sequence[int]) -> None:
        st = self._get(request_id)
        st.ready = greedy(self.model.extend(st.seq, list(tokens)))

    def finish(self, request_id: int) -> None:
        self._reqs.pop(request_id, None)
