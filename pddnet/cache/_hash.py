"""The per-block hash chain that names a prefix.

Block ``i`` of a prompt (tokens ``[i*bs, (i+1)*bs)``) is named by

    key[i] = H(token bytes of block i, seed = key[i-1]),   key[-1] = K_ROOT_KEY

so one 64-bit key stands for the whole prefix up to and including block ``i``:
two prompts share ``key[i]`` only if they share all of blocks ``0..i`` (up to
a hash collision). Only *full* blocks get keys; a trailing partial block is
never cached and always sent.

Tokens are hashed as little-endian uint32. The loop runs once per *block*, not
per token: NumPy turns the token array into one ``bytes`` object per block
in a single call (a ``void`` view and ``tolist``), and the chain then costs
one C call per block (about 0.1 µs for xxh3 on 64 bytes). A 128K-token
prompt at 16 tokens per block is 8192 calls, about 1 ms here (``pddnet bench
drc`` measures it as ``delta_ms_128k``).

Keys index the cache; they never decide what KV is reused on their own. The
main decoder compares the stored tokens of every block it matches
(:meth:`pddnet.cache.RadixCache.match_prefix`), so a collision, accidental or
crafted, costs at most a cache miss, never a wrong prefix. ``blake2b`` (keyed
by the chain) is offered where the hash must also resist crafted collisions
in the *mirror*, at about 3x the cost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .._errors import LayoutMismatch

__all__ = ["K_HASH_ALGOS", "K_ROOT_KEY", "block_hashes", "as_tokens"]

K_ROOT_KEY = 0  # the chain's seed: the "parent" of block 0


def _blake2b_chain(blocks: list[bytes], seed: int) -> list[int]:
    out: list[int] = []
    h = seed
    for b in blocks:
        d = hashlib.blake2b(b, digest_size=8, key=h.to_bytes(8, "little")).digest()
        h = int.from_bytes(d, "little")
        out.append(h)
    return out


def _xxh3_chain(blocks: list[bytes], seed: int) -> list[int]:
    out: list[int] = []
    append = out.append
    f = xxhash.xxh3_64_intdigest
    h = seed
    for b in blocks:
        h = f(b, h)
        append(h)
    return out


K_HASH_ALGOS: dict[str, Callable[[list[bytes], int], list[int]]] = {
    "xxh3_64": _xxh3_chain,
    "blake2b": _blake2b_chain,
}


def as_tokens(tokens: Any) -> npt.NDArray[np.uint32]:
    """Token ids as a flat contiguous little-endian uint32 array (no copy if already one).

    Raises:
        ValueError: if an id is negative or above 2**32 - 1.
    """
    arr = np.asarray(tokens)
    if arr.dtype == np.dtype("<u4") and arr.ndim == 1 and arr.flags.c_contiguous:
        return arr
    arr = arr.reshape(-1)
    if arr.size and arr.dtype.kind in "iu" and (arr.min() < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32 - 1]")
    return np.ascontiguousarray(arr, dtype="<u4")


def block_hashes(
    tokens: Any, block_size: int, *, algo: str = "xxh3_64", seed: int = K_ROOT_KEY
) -> npt.NDArray[np.uint64]:
    """The chained keys of every full block of ``tokens``.

    Args:
        tokens: token ids (any int sequence or array).
        block_size: tokens per block.
        algo: ``"xxh3_64"`` (default) or ``"blake2b"``.
        seed: the key of the parent of the first block (``K_ROOT_KEY`` for a
            prompt that starts at token 0).

    Returns:
        uint64 array of ``len(tokens) // block_size`` keys.

    Raises:
        LayoutMismatch: for an unknown ``algo`` or a non-positive ``block_size``.
    """
    if block_size <= 0:
        raise LayoutMismatch(f"block_size must be positive, got {block_size}")
    chain = K_HASH_ALGOS.get(algo)
    if chain is None:
        raise LayoutMismatch(f"unknown DRC hash algorithm {algo!r}; have {sorted(K_HASH_ALGOS)}")
    toks = as_tokens(tokens)
    n = toks.size // block_size
    if n == 0:
        return np.empty(0, np.uint64)
    rows = toks[: n * block_size].view(np.dtype((np.void, 4 * block_size)))
    return np.array(chain(rows.tolist(), seed), dtype=np.uint64)
