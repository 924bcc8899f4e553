"""A conformance suite every pddnet transport must pass.

``await check_transport(maker)`` runs the checks below against a transport and
raises ``AssertionError`` (with the check's name) on the first failure. It
imports no test framework, so a transport's own test module simply does::

    async def test_conformance():
        await check_transport(my_pair_factory)

``maker()`` must return an async context manager that yields a connected
``(sender, receiver)`` pair: a :class:`~pddnet.transport.Sender` able to
reach the :class:`~pddnet.transport.Receiver`. The pair is reused by all
checks (connections are meant to be reused across transfers). Every check is
bounded in time, so a hang fails instead of blocking.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import trio

from .._errors import LocalProtocolError, PddnetError, TransferCancelled, TransferTimeout
from ..kv import ByteRanges
from ._base import Receiver, Sender, TransferState

__all__ = ["Case", "TestCerts", "check_transport", "make_case", "make_test_certs"]

Maker = Callable[[], AbstractAsyncContextManager[tuple[Sender, Receiver]]]
K_SENTINEL = 0xA5
K_BOUND_S = 10.0


class Case:
    """Source and destination memory for one transfer, with fragmented ranges.

    The destination buffers are larger than the ranges and filled with
    ``K_SENTINEL``, so bytes outside the grant can be checked untouched.
    """

    def __init__(self, rng: np.random.Generator, total: int, pieces: int, layers: int = 1) -> None:
        cuts = (
            np.sort(rng.choice(np.arange(1, total), size=pieces - 1, replace=False))
            if (pieces > 1 and total > pieces)
            else np.array([], np.int64)
        )
        lengths = np.diff(np.concatenate(([0], cuts, [total]))).astype(np.int64)
        n = lengths.size
        layer = np.minimum(np.arange(n) * layers // max(n, 1), layers - 1)
        self.layers = layers
        # source: two buffers, ranges alternate between them, with gaps
        src_len = [int(total + 64 * n + 64)] * 2
        self.src = [rng.integers(0, 256, size=m, dtype=np.uint8) for m in src_len]
        self.dst = [np.full(m + 4096, K_SENTINEL, np.uint8) for m in src_len]
        sbuf = np.arange(n) % 2
        dbuf = (np.arange(n) + 1) % 2
        soff = self._offsets(lengths, sbuf, rng)
        doff = self._offsets(lengths, dbuf, rng)
        self.src_ranges = ByteRanges.build(sbuf, soff, lengths, layer)
        self.dst_ranges = ByteRanges.build(dbuf, doff, lengths, layer)
        self.total = total

    @staticmethod
    def _offsets(lengths: Any, buf: Any, rng: np.random.Generator) -> Any:
        off = np.zeros(lengths.size, np.int64)
        pos = [int(rng.integers(0, 64)), int(rng.integers(0, 64))]
        for i, (n, b) in enumerate(zip(lengths, buf, strict=True)):
            off[i] = pos[b]
            pos[b] += int(n) + int(rng.integers(1, 64))
        return off

    def expected(self) -> list[Any]:
        """What the destination buffers must hold after a complete transfer."""
        want = [np.full_like(d, K_SENTINEL) for d in self.dst]
        s, d = self.src_ranges, self.dst_ranges
        for i in range(len(s)):
            n = int(s.length[i])
            so, do = int(s.offset[i]), int(d.offset[i])
            want[int(d.buffer[i])][do : do + n] = self.src[int(s.buffer[i])][so : so + n]
        return want

    def check_complete(self) -> None:
        for got, want in zip(self.dst, self.expected(), strict=True):
            assert np.array_equal(got, want), "destination differs from source"

    def check_outside_untouched(self) -> None:
        mask = [np.ones(d.size, bool) for d in self.dst]
        d = self.dst_ranges
        for i in range(len(d)):
            o = int(d.offset[i])
            mask[int(d.buffer[i])][o : o + int(d.length[i])] = False
        for buf, m in zip(self.dst, mask, strict=True):
            assert (buf[m] == K_SENTINEL).all(), "a byte outside the grant was written"


def make_case(seed: int, total: int, pieces: int = 7, layers: int = 1) -> Case:
    return Case(np.random.default_rng(seed), total, pieces, layers)


async def _expect(
    exc_type: type[PddnetError], fn: Callable[[], Awaitable[None]], what: str
) -> None:
    try:
        with trio.fail_after(K_BOUND_S):
            await fn()
    except exc_type:
        return
    except trio.TooSlowError:
        raise AssertionError(f"{what}: no {exc_type.__name__} within {K_BOUND_S} s") from None
    raise AssertionError(f"{what}: finished without {exc_type.__name__}")


async def _roundtrip(tx: Sender, rx: Receiver, case: Case, **kw: Any) -> None:
    grant = rx.grant(case.dst, case.dst_ranges, num_layers=case.layers)
    assert grant.total == case.total, "grant total differs from the ranges"
    with trio.fail_after(K_BOUND_S):
        t = tx.start(grant, case.src, case.src_ranges, **kw)
        await t.wait()
        await rx.wait_transfer(grant.transfer_id)
    assert t.state is TransferState.DONE
    case.check_complete()


async def check_roundtrip(tx: Sender, rx: Receiver) -> None:
    case = make_case(1, 3 << 20, pieces=9)
    seen: list[int] = []
    grant = rx.grant(case.dst, case.dst_ranges)
    with trio.fail_after(K_BOUND_S):
        t = tx.start(grant, case.src, case.src_ranges, progress=lambda tid, n, tot: seen.append(n))
        await t.wait()
        await rx.wait_transfer(grant.transfer_id)
    case.check_complete()
    assert seen and seen[-1] == case.total and seen == sorted(seen), "progress not monotone"
    assert tx.statistics() is not None and rx.statistics() is not None


async def check_reuse(tx: Sender, rx: Receiver) -> None:
    for i in range(6):
        await _roundtrip(tx, rx, make_case(10 + i, 1000 + 77777 * i, pieces=1 + i))


async def check_tiny(tx: Sender, rx: Receiver) -> None:
    await _roundtrip(tx, rx, make_case(20, 1, pieces=1))
    await _roundtrip(tx, rx, make_case(21, 4097, pieces=3))


async def check_empty(tx: Sender, rx: Receiver) -> None:
    empty = ByteRanges.build([], [], [], [])
    grant = rx.grant([np.zeros(8, np.uint8)], empty)
    with trio.fail_after(K_BOUND_S):
        await tx.send(grant, [np.zeros(8, np.uint8)], empty)
        await rx.wait_transfer(grant.transfer_id)


async def check_concurrent(tx: Sender, rx: Receiver) -> None:
    cases = [make_case(30 + i, (i + 1) * 600_000, pieces=3 + i) for i in range(4)]
    async with trio.open_nursery() as n:
        for i, c in enumerate(cases):
            n.start_soon(functools.partial(_roundtrip, tx, rx, c, priority=i % 2))


async def check_layers(tx: Sender, rx: Receiver) -> None:
    case = make_case(40, 2 << 20, pieces=12, layers=4)
    grant = rx.grant(case.dst, case.dst_ranges, num_layers=4)
    assert len(grant.layer_ends) == 4 and grant.layer_ends[-1] == case.total
    with trio.fail_after(K_BOUND_S):
        t = tx.start(grant, case.src, case.src_ranges, ready=False)
        for layer in (2, 0, 3, 1):  # layers become ready out of order
            t.mark_layer_ready(layer)
            await rx.wait_layer(grant.transfer_id, layer)
            lo, hi = grant.layer_span(layer)
            got = b"".join(
                bytes(case.dst[b][o : o + n]) for b, o, n in case.dst_ranges.pieces(lo, hi)
            )
            want = b"".join(
                bytes(case.src[b][o : o + n]) for b, o, n in case.src_ranges.pieces(lo, hi)
            )
            assert got == want, f"layer {layer} reported ready but differs"
        await t.wait()
        await rx.wait_transfer(grant.transfer_id)
    case.check_complete()


async def check_sender_cancel(tx: Sender, rx: Receiver) -> None:
    case = make_case(50, 1 << 20)
    grant = rx.grant(case.dst, case.dst_ranges)
    t = tx.start(grant, case.src, case.src_ranges, ready=False)
    t.mark_ready(0, 4096)
    t.cancel()
    t.cancel()  # idempotent
    await _expect(TransferCancelled, t.wait, "sender cancel, sender side")
    await _expect(
        TransferCancelled, lambda: rx.wait_transfer(grant.transfer_id), "sender cancel, receiver"
    )
    assert t.state is TransferState.CANCELLED
    case.check_outside_untouched()


async def check_receiver_cancel(tx: Sender, rx: Receiver) -> None:
    case = make_case(51, 1 << 20)
    grant = rx.grant(case.dst, case.dst_ranges)
    t = tx.start(grant, case.src, case.src_ranges, ready=False)
    await trio.sleep(0.01)
    rx.cancel(grant.transfer_id)
    await _expect(TransferCancelled, t.wait, "receiver cancel, sender side")
    await _expect(
        TransferCancelled, lambda: rx.wait_transfer(grant.transfer_id), "receiver cancel, receiver"
    )
    case.check_outside_untouched()


async def check_deadlines(tx: Sender, rx: Receiver) -> None:
    case = make_case(52, 1 << 20)
    grant = rx.grant(case.dst, case.dst_ranges)
    t = tx.start(grant, case.src, case.src_ranges, ready=False, timeout=0.2)
    await _expect(TransferTimeout, t.wait, "sender deadline")
    await _expect(
        TransferCancelled, lambda: rx.wait_transfer(grant.transfer_id), "sender deadline, receiver"
    )
    case2 = make_case(53, 1 << 20)
    grant2 = rx.grant(case2.dst, case2.dst_ranges, timeout=0.2)
    t2 = tx.start(grant2, case2.src, case2.src_ranges, ready=False)
    await _expect(TransferTimeout, lambda: rx.wait_transfer(grant2.transfer_id), "grant deadline")
    await _expect(TransferTimeout, t2.wait, "grant deadline, sender side")


async def check_misuse(tx: Sender, rx: Receiver) -> None:
    case = make_case(54, 10000)
    grant = rx.grant(case.dst, case.dst_ranges)
    short = ByteRanges.build([0], [0], [100], [0])
    try:
        tx.start(grant, case.src, short)
    except LocalProtocolError:
        pass
    else:
        raise AssertionError("a source not matching the grant was accepted")
    try:
        await rx.wait_transfer(grant.transfer_id ^ 0x5A5A5A)
    except LocalProtocolError:
        pass
    else:
        raise AssertionError("waiting on a never-granted id did not fail")
    rx.cancel(grant.transfer_id)


CHECKS: dict[str, Callable[[Sender, Receiver], Awaitable[None]]] = {
    "roundtrip": check_roundtrip,
    "reuse": check_reuse,
    "tiny": check_tiny,
    "empty": check_empty,
    "concurrent": check_concurrent,
    "layers": check_layers,
    "sender_cancel": check_sender_cancel,
    "receiver_cancel": check_receiver_cancel,
    "deadlines": check_deadlines,
    "misuse": check_misuse,
}


async def check_transport(maker: Maker, only: list[str] | None = None) -> list[str]:
    """Run the conformance checks against the transport ``maker`` builds.

    Args:
        maker: returns an async context manager yielding ``(sender, receiver)``.
        only: names of checks to run (default all, in :data:`CHECKS` order).

    Returns:
        The names of the checks that ran (all passed).

    Raises:
        AssertionError: naming the first check that failed.
    """
    ran = []
    async with maker() as (tx, rx):
        for name, check in CHECKS.items():
            if only is not None and name not in only:
                continue
            try:
                await check(tx, rx)
            except AssertionError as exc:
                raise AssertionError(f"transport check {name!r} failed: {exc}") from exc
            except PddnetError as exc:
                raise AssertionError(f"transport check {name!r} raised {exc!r}") from exc
            ran.append(name)
    return ran


# -- throwaway certificates for TLS tests and benchmarks ----------------------------


@dataclass(frozen=True, slots=True)
class TestCerts:
    """PEM files made by :func:`make_test_certs` (paths as strings)."""

    __test__ = False  # not a pytest class

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # an unrelated CA: verifies neither certificate


def make_test_certs(directory: str | Path, *, hostname: str = "127.0.0.1") -> TestCerts | None:
    """Make a CA, a server and a client certificate it signs, and an unrelated CA.

    Uses the ``openssl`` command (EC P-256 keys, 1 day). For tests and
    benchmarks only: the keys are unencrypted.

    Args:
        directory: where to write the PEM files.
        hostname: the server certificate's subjectAltName (an IP or a DNS name);
            ``localhost`` is always added.

    Returns:
        The file paths, or None when no ``openssl`` command is installed.

    Raises:
        subprocess.CalledProcessError: if ``openssl`` fails.
    """
    exe = shutil.which("openssl")
    if exe is None:
        return None
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*argv: str) -> None:
        subprocess.run([exe, *argv], check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other_ca"):
        run("req", "-x509", *ec, "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem"),
            "-days", "1", "-subj", f"/CN=pddnet test {ca}")  # fmt: skip
    kind = "IP" if hostname.replace(".", "").isdigit() or ":" in hostname else "DNS"
    for who, ext in (
        ("server", f"subjectAltName={kind}:{hostname},DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, csr, pem = (str(d / f"{who}.{x}") for x in ("key", "csr", "pem"))
        run("req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN=pddnet test {who}")
        extfile = d / f"{who}.ext"
        extfile.write_text(ext + "\n")
        run("x509", "-req", "-in", csr, "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
            "-CAcreateserial", "-out", pem, "-days", "1", "-extfile", str(extfile))  # fmt: skip
    return TestCerts(
        ca=str(d / "ca.pem"),
        server_cert=str(d / "server.pem"),
        server_key=str(d / "server.key"),
        client_cert=str(d / "client.pem"),
        client_key=str(d / "client.key"),
        other_ca=str(d / "other_ca.pem"),
    )
