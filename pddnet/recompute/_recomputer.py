"""The engine hook for eager-token recompute.

When MD takes over a request from RLD it holds the prompt's KV (by transfer) and
the ids of the tokens RLD generated. A :class:`Recomputer` rebuilds those
tokens' KV in one multi-token forward pass (an *extend*), so that MD can carry
on decoding exactly where RLD stopped.

Contract (every implementation, pddnet's or an engine's):

* **Input.** ``seq`` has valid KV for positions ``[0, seq.length)``; ``tokens``
  are the ids to append, in order (RLD's eager tokens, ``n >= 1``).
* **Blocks it may write.** Only the slots of positions ``seq.length ..
  seq.length + n - 1``: block ``block_table[p // block_size]``, slot
  ``p % block_size`` for each such ``p``. In the first, partly filled block the
  earlier slots are read-only, and so is every block wholly before
  ``seq.length``: they may be prefix-cache blocks shared with other requests.
  The caller provides a block table that covers ``seq.length + n`` tokens (an
  implementation with an allocator may grow it instead; it must never shrink it).
* **Stream.** On a GPU, the work is enqueued on the caller's *current* CuPy
  stream (``with stream:``), or on ``stream`` when one is given, and the call
  does not synchronise. Work on other streams must wait for an event recorded
  on it before reading the new KV or the logits.
* **Result.** ``seq.length`` grows by ``n`` and :meth:`Recomputer.recompute`
  returns the float32 logits of the last new token (``[vocab]``, on the
  device of the KV). Its argmax is the token RLD would have produced next by
  decoding, so MD's next decode step continues the same stream of tokens.
* **Errors.** :class:`~pddnet.ResourceLimitError` if the block table is too
  short; :class:`~pddnet.LocalProtocolError` for an empty ``tokens``. On an error
  nothing has been written and ``seq`` is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Protocol, runtime_checkable

from ._model import PagedSequence, ReferenceModel

__all__ = ["ModelRecomputer", "Recomputer"]


@runtime_checkable
class Recomputer(Protocol):
    """Rebuilds the KV of token ids appended to a paged sequence (see module doc)."""

    def recompute(self, seq: PagedSequence, tokens: Sequence[int], *, stream: Any = None) -> Any:
        """Write the KV of ``tokens`` after ``seq``'s prefix; return the last logits row."""
        ...


class ModelRecomputer:
    """pddnet's default :class:`Recomputer`: :meth:`ReferenceModel.extend`.

    Args:
        model: the reference model that owns the KV pool.
    """

    def __init__(self, model: ReferenceModel) -> None:
        self.model = model

    def recompute(self, seq: PagedSequence, tokens: Sequence[int], *, stream: Any = None) -> Any:
        """Extend ``seq`` by ``tokens`` (see the module doc for the contract).

        Args:
            seq: the sequence; valid KV for ``[0, seq.length)``.
            tokens: the ids to append.
            stream: a CuPy stream to run on (GPU models only); default: current.

        Returns:
            float32 logits ``[vocab]`` of the last token.

        Raises:
            LocalProtocolError: for no tokens or an id outside the vocabulary.
            ResourceLimitError: if the block table is too short and cannot grow.
        """
        ctx = stream if stream is not None else nullcontext()
        with ctx:
            return self.model.extend(seq, tokens)
