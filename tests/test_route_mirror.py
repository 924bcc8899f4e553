"""P's mirror of one MD's cache as the router reads it: blocks P saw land on
MD count as held until MD's own event about them (or ``expect_s``), blocks in
flight do not, and a probe by key list gives what the array gives."""

from __future__ import annotations

import numpy as np

from pddnet.cache import CacheMirror, DrcEvicted, DrcInserted, block_hashes

BS = 16


def keys_of(n_tokens: int, seed: int = 0) -> list[int]:
    toks = np.random.default_rng(seed).integers(0, 1000, n_tokens)
    return [int(k) for k in block_hashes(toks, BS)]


def test_landed_blocks_count_as_held_until_md_speaks_or_they_expire() -> None:
    m = CacheMirror(BS, expect_s=5.0)
    a = keys_of(160)  # 10 blocks
    m.apply(DrcInserted(1, 1, a[:4]))
    assert m.predict(a) == 4  # only what MD announced; the rest is not there yet
    m.expect(a, now=100.0)  # P's transfer of the whole prompt landed
    assert m.predict(a) == 10 and m.predict(np.array(a, dtype=np.uint64)) == 10
    assert len(m) == 4  # expectations are not MD's cache
    m.apply(DrcInserted(1, 2, a[4:8]))  # MD cached 8 of them
    m.apply(DrcEvicted(1, 3, a[6:8]))  # ... and evicted two: MD's word wins, and
    assert m.predict(a) == 6  # the expected a[8:] are no use past the break
    m.apply(DrcInserted(1, 4, a[6:8]))  # cached again (another request): a[8:] stay unexpected
    assert m.predict(a) == 8
    b = keys_of(80, seed=1)
    m.expect(b, now=103.0)
    m.expire(105.0)  # a's expectation (until 105) ends; b's (until 108) holds
    assert m.predict(b) == 5
    m.expire(108.0)
    assert m.predict(b) == 0


def test_a_restarted_md_voids_expectations() -> None:
    m = CacheMirror(BS)
    a = keys_of(64)
    m.apply(DrcInserted(1, 1, a[:1]))
    m.expect(a, now=0.0)
    assert m.predict(a) == 4
    m.apply(DrcInserted(2, 1, a[:1]))  # epoch 2: MD restarted
    assert m.predict(a) == 1


def test_list_and_array_probes_agree() -> None:
    rng = np.random.default_rng(3)
    m = CacheMirror(BS)
    prompts = [keys_of(int(rng.integers(16, 600)), seed=i) for i in range(50)]
    for seq, p in enumerate(prompts[:30], start=1):
        m.apply(DrcInserted(1, seq, p[: int(rng.integers(0, len(p) + 1))]))
    for p in prompts[25:40]:
        m.expect(p[: len(p) // 2], now=0.0)
    for p in prompts:
        assert m.predict(p) == m.predict(np.array(p, dtype=np.uint64))
