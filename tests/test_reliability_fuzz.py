"""Fuzzing every decoder from the corpus in tests/corpus/, and a live ControlNode.

Each decoder, given any bytes, either decodes (and what it decodes survives a
re-encode) or raises its typed error; nothing else, no hang. The corpus seeds
(``ok-*`` must decode, ``bad-*`` must fail) are replayed exactly, then mutated
by Hypothesis. Control frames are also re-tagged after mutation so that the
fuzzer reaches the msgpack and schema checks behind the HMAC.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pddnet import AuthError, PddnetError, RemoteProtocolError
from pddnet.api import EndpointInfo
from pddnet.bench._hostile_control import raw_dealer
from pddnet.control import ControlNode
from pddnet.transport.wan._framing import LinkFrame
from pddnet.wire import (
    ChunkHeader,
    Hello,
    Ping,
    decode_frame,
    decode_tokens,
    encode_frame,
    encode_tokens,
)
from pddnet.wire._auth import AuthFrame
from pddnet.wire._control import K_TAG_SIZE, _tag

CORPUS = Path(__file__).parent / "corpus"
KEY = b"corpus-key-0123456789abcdef012345"  # as tests/corpus/_make.py
SRC, DST = "p0", "md0"


def _chunk(data: bytes) -> Any:
    h = ChunkHeader.decode(data)
    assert ChunkHeader.decode(h.encode()) == h
    assert h.encode() == data  # the header has one encoding: CRC and strict fields
    return h


def _frame(data: bytes) -> Any:
    f = decode_frame(data, key=KEY, src=SRC, dst=DST)
    again = encode_frame(f.message, key=KEY, src=SRC, dst=DST, seq=f.seq, corr=f.corr, kind=f.kind)
    assert decode_frame(again, key=KEY, src=SRC, dst=DST) == f
    return f


def _tokens(data: bytes) -> Any:
    toks = decode_tokens(data, max_tokens=4096)
    assert (decode_tokens(encode_tokens(toks), 4096) == toks).all()
    return toks


def _blob(data: bytes) -> Any:
    info = EndpointInfo.from_blob(data)
    assert EndpointInfo.from_blob(info.blob()) == info
    return info


def _link(data: bytes) -> Any:
    f = LinkFrame.decode(data)
    assert f.encode() == data
    return f


def _auth(data: bytes) -> Any:
    f = AuthFrame.decode(data)
    assert f.encode() == data
    return f


# decoder name (corpus subdirectory) -> (decode-and-check, the typed error it may raise)
DECODERS: dict[str, tuple[Callable[[bytes], Any], type[PddnetError]]] = {
    "chunk_header": (_chunk, RemoteProtocolError),
    "control_frame": (_frame, PddnetError),  # AuthError or RemoteProtocolError
    "tokens": (_tokens, RemoteProtocolError),
    "endpoint_blob": (_blob, RemoteProtocolError),
    "link_frame": (_link, RemoteProtocolError),
    "auth_frame": (_auth, AuthError),
}


def corpus(name: str) -> list[Path]:
    return sorted((CORPUS / name).glob("*.bin"))


SEEDS = [(name, path) for name in DECODERS for path in corpus(name)]


def test_corpus_covers_every_decoder() -> None:
    for name in DECODERS:
        files = corpus(name)
        assert any(f.name.startswith("ok-") for f in files), name
        assert any(f.name.startswith("bad-") for f in files), name


@pytest.mark.parametrize("name,path", SEEDS, ids=[f"{n}/{p.name}" for n, p in SEEDS])
def test_corpus_replays(name: str, path: Path) -> None:
    decode, err = DECODERS[name]
    data = path.read_bytes()
    if path.name.startswith("ok-"):
        decode(data)
    else:
        with pytest.raises(err):
            decode(data)


def _mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, val in ops:
        at = pos % (len(buf) + 1)
        if op == 0 and buf:  # overwrite a byte
            buf[at % len(buf)] = val
        elif op == 1:  # insert a byte
            buf.insert(at, val)
        elif op == 2 and buf:  # delete a byte
            del buf[at % len(buf)]
        elif op == 3:  # truncate
            del buf[at:]
        elif op == 4 and buf:  # flip one bit
            buf[at % len(buf)] ^= 1 << (val % 8)
    return bytes(buf)


mutations = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), mutations, st.booleans())
def test_fuzz_mutated_seeds(seed: tuple[str, Path], ops: Any, retag: bool) -> None:
    name, path = seed
    decode, err = DECODERS[name]
    data = _mutate(path.read_bytes(), ops)
    if name == "control_frame" and retag and len(data) > K_TAG_SIZE:
        body = data[K_TAG_SIZE:]
        data = _tag(KEY, SRC, DST, body) + body  # get past the MAC to the parser
    with contextlib.suppress(err):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(DECODERS)), st.binary(max_size=200))
def test_fuzz_random_bytes(name: str, data: bytes) -> None:
    decode, err = DECODERS[name]
    with contextlib.suppress(err):
        decode(data)


# ---------------------------------------------------------------- a live node
def _raw_frames(rng: random.Random, genuine: list[bytes]) -> list[bytes]:
    """Hostile frames: random bytes, mutated genuine frames, re-tagged garbage
    under a wrong key, corpus seeds, oversize frames."""
    wrong = b"not-the-key-but-long-enough-000000"
    out: list[bytes] = []
    seeds = [p.read_bytes() for p in corpus("control_frame")]
    for i in range(1500):
        kind = i % 6
        if kind == 0:
            out.append(rng.randbytes(rng.randrange(0, 200)))
        elif kind == 1:
            g = bytearray(rng.choice(genuine))
            g[rng.randrange(len(g))] ^= 1 << rng.randrange(8)
            out.append(bytes(g))
        elif kind == 2:
            body = _mutate(rng.choice(seeds)[K_TAG_SIZE:], [(0, rng.randrange(99), 0x90)])
            out.append(_tag(wrong, SRC, DST, body) + body)
        elif kind == 3:
            out.append(rng.choice(seeds))  # tagged with the corpus key, not the node's
        elif kind == 4:
            out.append(rng.choice(genuine))  # verbatim replays
        else:
            out.append(rng.randbytes(rng.choice([1, 17, 4096])))
    out.append(b"\x00" * (2 << 20))  # over the node's size limit
    return out


async def test_hostile_frames_into_a_live_node() -> None:
    """Nothing forged, tampered or replayed is delivered; the node keeps working."""
    node_key = b"live-node-key-0123456789abcdef0123"
    got: list[tuple[str, bytes]] = []

    def on_hello(peer: str, msg: Hello) -> None:
        got.append((peer, msg.handshake))

    async with ControlNode("md0", secret=node_key) as md:
        md.route(Hello, on_hello)
        # 1. the genuine p0 sends three events and a request, then goes away
        async with ControlNode("p0", secret=node_key) as p0:
            await p0.connect("md0", md.address)
            for i in range(3):
                await p0.send("md0", Hello("p0", 1, bytes([i])))
            assert await p0.request("md0", Ping(b"x"), timeout=5) is not None
        with trio.fail_after(5):
            while len(got) < 3:
                await trio.sleep(0.01)
        # 2. an attacker that sniffed those frames connects as "p0" and as strangers
        genuine = [
            encode_frame(Hello("p0", 1, b"\x09"), key=node_key, src="p0", dst="md0", seq=1),
            encode_frame(Ping(b"y"), key=node_key, src="p0", dst="md0", seq=2),
        ]
        before = md.statistics()
        frames = _raw_frames(random.Random(1234), genuine)
        ctx: zmq.Context[Any] = zmq.Context.instance()
        # (they hold the key, so pass the CURVE handshake: the frame checks are under test)
        socks = [
            raw_dealer(ctx, md.address, ident, key=node_key)
            for ident in (b"p0", b"evil", b"\xff\xfe")
        ]
        try:
            for i, f in enumerate(frames):
                s = socks[i % 3]
                parts = [f] if i % 7 else [f, b"extra part"]
                s.send_multipart(parts)
                if i % 100 == 0:
                    await trio.sleep(0)
            # Wait until md has read everything that reaches it.
            with trio.fail_after(20):
                seen, quiet = -1, 0
                while quiet < 10:
                    now = md.statistics().received
                    quiet = quiet + 1 if now == seen else 0
                    seen = now
                    await trio.sleep(0.05)
            assert md.statistics().received - before.received >= len(frames) * 2 // 3
        finally:
            for s in socks:
                s.close(0)
        after = md.statistics()
        rejected = sum(
            getattr(after, k) - getattr(before, k)
            for k in ("rejected_auth", "rejected_replay", "rejected_malformed")
        )
        assert rejected == after.received - before.received  # every frame was dropped
        assert after.delivered == before.delivered  # ... and none delivered
        assert [h for _, h in got] == [b"\x00", b"\x01", b"\x02"]
        # 3. the node still works for the genuine peer, reconnecting as "p0"
        async with ControlNode("p0", secret=node_key) as p0:
            await p0.connect("md0", md.address)
            await p0.send("md0", Hello("p0", 1, b"\x05"))
            assert await p0.request("md0", Ping(b"z"), timeout=5) is not None
            with trio.fail_after(5):
                while len(got) < 4:
                    await trio.sleep(0.01)
        assert got[-1] == ("p0", b"\x05")


async def test_identity_squatter_cannot_take_over_a_route() -> None:
    key = b"live-node-key-0123456789abcdef0123"
    got: list[bytes] = []
    async with ControlNode("md0", secret=key) as md, ControlNode("p0", secret=key) as p0:
        p0.route(Hello, lambda peer, m: got.append(m.handshake))
        await p0.connect("md0", md.address)
        await p0.ping("md0", timeout=5)
        squatter: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.setsockopt(zmq.IDENTITY, b"p0")
        squatter.connect(md.address)
        try:
            squatter.send(b"x" * 40)  # unauthenticated garbage; the connect is what counts
            await trio.sleep(0.3)
            await md.send("p0", Hello("md0", 1, b"b"))  # md0 -> p0 over its ROUTER
            with trio.move_on_after(2):
                while not got:
                    await trio.sleep(0.02)
            assert got == [b"b"], "the squatter received p0's frame"
        finally:
            squatter.close(0)


async def test_concurrent_sends_while_connecting_are_all_delivered() -> None:
    key = b"reorder-key-0123456789abcdef0123456"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    got: list[int] = []
    async with ControlNode("a", secret=key) as a:
        await a.connect("b", addr)  # b is not there yet: the sends park on zmq.Again
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(a.send, "b", Hello("a", 1, bytes([i])))
            await trio.sleep(0.3)
            async with ControlNode("b", secret=key, bind=addr) as b:
                b.route(Hello, lambda peer, m: got.append(m.handshake[0]))
                with trio.move_on_after(3):
                    while len(got) < 50:
                        await trio.sleep(0.02)
    assert sorted(got) == list(range(50)), f"{50 - len(got)} of 50 sends were dropped"
