"""Sans-IO tests of the link model (no network, time is a parameter)."""

from __future__ import annotations

import math

import pytest

from pddnet.emu import DirectionShaper, GilbertElliott, LinkSpec


def _run(spec: LinkSpec, n: int, size: int = 1000, gap: float = 0.0) -> list[float | None]:
    sh = DirectionShaper(spec)
    return [sh.push(bytes(size), i * gap) for i in range(n)]


def test_delay_only_is_exact() -> None:
    dues = _run(LinkSpec(delay=0.015), 10, gap=0.001)
    assert dues == pytest.approx([i * 0.001 + 0.015 for i in range(10)])


def test_rate_serialises_back_to_back_packets() -> None:
    # 8 Mbit/s = 1 MB/s: a 1000-byte packet takes 1 ms on the wire.
    dues = _run(LinkSpec(delay=0.010, rate=8e6, queue_bytes=1 << 20), 100)
    assert dues[0] == pytest.approx(0.011)
    assert dues[-1] == pytest.approx(0.010 + 100 * 0.001)


def test_drop_tail_queue_limit_and_throughput() -> None:
    sh = DirectionShaper(LinkSpec(delay=0.0, rate=8e6, queue_bytes=10_000))
    # Offer 3x the link rate for one second: about 2/3 must be dropped at the tail.
    accepted = 0
    for i in range(3000):
        if sh.push(bytes(1000), i / 3000) is not None:
            accepted += 1
    assert sh.stats.queue_drops == 3000 - accepted
    assert accepted == pytest.approx(1000 + 10, abs=3)  # one second of link + the queue
    assert sh.stats.max_backlog_bytes <= 10_000


def test_default_queue_is_one_bdp() -> None:
    spec = LinkSpec(delay=0.015, rate=1e9)
    assert DirectionShaper(spec).queue_limit == int(1e9 * 0.030 / 8)
    assert DirectionShaper(LinkSpec(delay=0.0, rate=1e6)).queue_limit == 64 * 1024


def test_jitter_does_not_reorder_unless_asked() -> None:
    spec = LinkSpec(delay=0.010, jitter=0.002, seed=3)
    dues = [d for d in _run(spec, 2000, gap=0.0001) if d is not None]
    assert dues == sorted(dues)
    spread = [d - 0.010 - i * 0.0001 for i, d in enumerate(dues)]
    assert max(spread) > 0.002  # the jitter is really there
    loose = [
        d
        for d in _run(LinkSpec(delay=0.010, jitter=0.002, allow_reorder=True), 2000, gap=0.0001)
        if d is not None
    ]
    assert loose != sorted(loose)


def test_pop_due_returns_delivery_order_with_reordering() -> None:
    sh = DirectionShaper(LinkSpec(delay=0.010, reorder=0.25, seed=7))
    for i in range(400):
        sh.push(i.to_bytes(4, "big"), i * 0.0001)
    out = sh.pop_due(1.0)
    dues = [d for d, _ in out]
    assert dues == sorted(dues)
    order = [int.from_bytes(p, "big") for _, p in out]
    assert order != sorted(order)
    assert sh.stats.reordered == pytest.approx(100, abs=35)
    assert len(sh) == 0


def _binomial_ok(k: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    return abs(k - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def test_random_loss_rate_and_reproducibility() -> None:
    spec = LinkSpec(loss=0.05, seed=11)
    a = _run(spec, 20_000)
    lost = sum(d is None for d in a)
    assert _binomial_ok(lost, 20_000, 0.05)
    assert a == _run(spec, 20_000)  # same seed, same packets lost
    assert a != _run(LinkSpec(loss=0.05, seed=12), 20_000)


def test_gilbert_elliott_mean_and_burstiness() -> None:
    ge = GilbertElliott(p=0.01, r=0.25, loss_bad=1.0, loss_good=0.0)
    spec = LinkSpec(ge=ge, seed=5)
    dues = _run(spec, 100_000)
    lost = [d is None for d in dues]
    rate = sum(lost) / len(lost)
    assert ge.mean_loss() == pytest.approx(0.01 / 0.26)
    assert rate == pytest.approx(ge.mean_loss(), rel=0.15)
    # Bursts: mean run of consecutive losses is 1/r = 4 packets (random loss: ~1.04).
    runs, cur = [], 0
    for x in lost:
        if x:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    assert sum(runs) / len(runs) == pytest.approx(4.0, rel=0.2)


def test_loss_happens_after_the_queue() -> None:
    # A lost packet still used link time: the next one departs after it.
    sh = DirectionShaper(LinkSpec(rate=8e6, loss=1.0, queue_bytes=1 << 20))
    assert sh.push(bytes(1000), 0.0) is None
    sh.spec = LinkSpec(rate=8e6, queue_bytes=1 << 20)
    assert sh.push(bytes(1000), 0.0) == pytest.approx(0.002)
