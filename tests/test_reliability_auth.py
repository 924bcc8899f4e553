"""The data-connection challenge-response handshake (pddnet/wire/_auth.py)."""

from __future__ import annotations

import hmac

import pytest
import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pddnet import AuthError, LocalProtocolError
from pddnet.wire import _auth
from pddnet.wire._auth import (
    K_AUTH_FRAME_SIZE,
    AuthFrame,
    AuthHandshake,
    AuthKind,
    AuthRole,
    AuthState,
    auth_context,
)

KEY = b"reliability-auth-secret-0123456789"
CTX = auth_context("wan", "p0", "md0")


def pair(
    key_i: bytes = KEY, key_r: bytes = KEY, ctx_i: bytes = CTX, ctx_r: bytes = CTX
) -> tuple[AuthHandshake, AuthHandshake]:
    return (
        AuthHandshake(AuthRole.INITIATOR, key_i, ctx_i, now=0.0),
        AuthHandshake(AuthRole.RESPONDER, key_r, ctx_r, now=0.0),
    )


def pump(a: AuthHandshake, b: AuthHandshake, rounds: int = 4) -> list[Exception]:
    """Exchange bytes until both settle; collect the AuthErrors either side raised."""
    errors: list[Exception] = []
    for _ in range(rounds):
        for src, dst in ((a, b), (b, a)):
            out = src.data_to_send()
            if out and dst.state not in (AuthState.DONE, AuthState.FAILED):
                try:
                    dst.receive_data(out)
                except AuthError as exc:
                    errors.append(exc)
    return errors


def test_roundtrip_one_rtt_and_leftover_is_kept() -> None:
    i, r = pair()
    ci, cr = i.data_to_send(), r.data_to_send()
    assert len(ci) == len(cr) == K_AUTH_FRAME_SIZE
    i.receive_data(cr)
    r.receive_data(ci)
    pi, pr = i.data_to_send(), r.data_to_send()
    assert len(pi) == len(pr) == K_AUTH_FRAME_SIZE
    assert pi != pr  # the role is bound: the two proofs differ
    r.receive_data(pi + b"first chunk bytes")
    i.receive_data(pr)
    assert i.done and r.done
    assert r.leftover == b"first chunk bytes" and i.leftover == b""
    assert i.get_timer() is None and i.bytes_wanted() == 0
    with pytest.raises(LocalProtocolError):
        i.receive_data(b"x")


def test_byte_at_a_time() -> None:
    i, r = pair()
    for _ in range(3):
        for src, dst in ((i, r), (r, i)):
            for b in src.data_to_send():
                if not dst.done:
                    dst.receive_data(bytes([b]))
    assert i.done and r.done


@pytest.mark.parametrize(
    "kw",
    [
        {"key_r": b"another-secret-of-enough-length!!"},
        {"ctx_r": auth_context("local", "p0", "md0")},  # other channel
        {"ctx_r": auth_context("wan", "p0", "rld0")},  # other peer
    ],
)
def test_mismatch_fails_both_sides_with_auth_error(kw: dict[str, bytes]) -> None:
    i, r = pair(**kw)
    errors = pump(i, r)
    assert i.state is AuthState.FAILED and r.state is AuthState.FAILED
    assert len(errors) == 2 and all(isinstance(e, AuthError) for e in errors)
    # the side that checked first says why; the other learns of the rejection
    msgs = sorted(str(e) for e in errors)
    assert any("does not verify" in m for m in msgs)
    assert isinstance(i.error, AuthError) and isinstance(r.error, AuthError)


def test_replayed_proof_fails_against_a_fresh_nonce() -> None:
    i, r = pair()
    recorded = i.data_to_send()
    r_out = r.data_to_send()
    i.receive_data(r_out)
    r.receive_data(recorded)
    recorded += i.data_to_send()  # the initiator's CHALLENGE + PROOF, as sniffed
    # the attacker replays them to a new responder, which picks a new nonce
    r2 = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    with pytest.raises(AuthError, match="does not verify"):
        r2.receive_data(recorded)
    assert not r2.done and r2.data_to_send().endswith(AuthFrame(AuthKind.FAIL).encode())


def test_reflection_is_refused() -> None:
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    own = r.data_to_send()
    with pytest.raises(AuthError, match="reflected"):
        r.receive_data(own)
    # echoing a proof built for the other nonce ordering: bound role makes it fail
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    r.data_to_send()
    r.receive_data(AuthFrame(AuthKind.CHALLENGE, b"\x01" * 32).encode())
    its_proof = r.data_to_send()
    with pytest.raises(AuthError, match="does not verify"):
        r.receive_data(its_proof)


@pytest.mark.parametrize(
    "blob,match",
    [
        (AuthFrame(AuthKind.PROOF, b"\0" * 32).encode(), "can't handle"),
        (b"PDDC" + bytes(36), "magic"),  # a chunk header before authenticating
        (b"PDDA\x02\x01\0\0" + bytes(32), "version"),
        (b"PDDA\x01\x09\0\0" + bytes(32), "kind"),
        (b"PDDA\x01\x01\x01\0" + bytes(32), "version"),
        (AuthFrame(AuthKind.FAIL).encode(), "rejected"),
    ],
)
def test_malformed_first_frame(blob: bytes, match: str) -> None:
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    r.data_to_send()
    with pytest.raises(AuthError, match=match):
        r.receive_data(blob)
    assert r.state is AuthState.FAILED
    with pytest.raises(LocalProtocolError):
        r.receive_data(blob)


def test_flood_is_not_buffered() -> None:
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    with pytest.raises(AuthError):
        r.receive_data(b"\xff" * (1 << 20))
    assert len(r._buf) < (1 << 20)  # it stopped at the first bad frame
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    r.receive_data(b"PDDA")
    assert r.bytes_wanted() == K_AUTH_FRAME_SIZE - 4


def test_deadline_bounds_a_silent_peer() -> None:
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=100.0, timeout=2.0)
    assert r.get_timer() == 102.0
    r.handle_timer(101.9)
    assert r.state is AuthState.CHALLENGED
    r.receive_data(b"PDDA\x01")  # slowloris: a partial frame, then nothing
    with pytest.raises(AuthError, match="timed out"):
        r.handle_timer(102.0)
    assert r.state is AuthState.FAILED and r.get_timer() is None


def test_bad_parameters() -> None:
    with pytest.raises(AuthError):
        AuthHandshake(AuthRole.INITIATOR, b"short", CTX, now=0.0)
    with pytest.raises(LocalProtocolError):
        AuthHandshake(AuthRole.INITIATOR, KEY, b"x" * 300, now=0.0)
    with pytest.raises(LocalProtocolError):
        AuthHandshake(AuthRole.INITIATOR, KEY, CTX, now=0.0, nonce=b"abc")
    with pytest.raises(LocalProtocolError):
        auth_context("wan", "p\0", "md")
    with pytest.raises(LocalProtocolError):
        auth_context("wan", "p" * 200, "m" * 200)


def test_proof_check_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(_auth.hmac, "compare_digest", spy)
    i, r = pair()
    assert pump(i, r) == [] and i.done and r.done
    assert sum(len(a) == 32 for a, _ in calls) >= 4  # nonce + proof checks, both sides


def test_tag_covers_every_input() -> None:
    """Changing any one input (nonce, role, context, key) changes the proof."""
    base = dict(context=CTX, nonce=b"\x01" * 32)
    peer = AuthFrame(AuthKind.CHALLENGE, b"\x02" * 32).encode()

    def proof(role: AuthRole = AuthRole.INITIATOR, key: bytes = KEY, **kw: bytes) -> bytes:
        args = {**base, **kw}
        hs = AuthHandshake(role, key, args["context"], now=0.0, nonce=args["nonce"])
        hs.data_to_send()
        hs.receive_data(peer)
        return hs.data_to_send()

    ref = proof()
    assert proof() == ref  # deterministic given the nonces
    assert proof(role=AuthRole.RESPONDER) != ref
    assert proof(key=KEY + b"x") != ref
    assert proof(context=CTX + b"x") != ref
    assert proof(nonce=b"\x03" * 32) != ref


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4 * K_AUTH_FRAME_SIZE))
@example(b"")
@example(AuthFrame(AuthKind.CHALLENGE, b"\x07" * 32).encode() + bytes(40))
@example(AuthFrame(AuthKind.CHALLENGE, b"\x07" * 32).encode() + b"PDDA\x01\x02\0\0" + bytes(32))
def test_fuzz_stranger_never_authenticates(data: bytes) -> None:
    r = AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=0.0)
    try:
        r.receive_data(data)
    except AuthError:
        assert r.state is AuthState.FAILED
    assert not r.done
    assert r.leftover == b""


# ---------------------------------------------------------------- a trio driver
async def _authenticate(stream: trio.abc.Stream, hs: AuthHandshake, timeout: float = 5.0) -> bytes:
    """The shape a transport driver takes: write what the machine says, read
    exactly what it wants, under its deadline; return the leftover bytes."""
    with trio.move_on_at(trio.current_time() + timeout):
        while not hs.done:
            out = hs.data_to_send()
            if out:
                await stream.send_all(out)
            data = await stream.receive_some(hs.bytes_wanted())
            if not data:
                raise AuthError("the peer closed during the handshake")
            try:
                hs.receive_data(data)
            except AuthError:
                with trio.move_on_after(0.5):
                    await stream.send_all(hs.data_to_send())  # the FAIL frame
                raise
        await stream.send_all(hs.data_to_send())
        return hs.leftover
    raise AuthError("auth handshake timed out")


async def test_over_a_stream_pair() -> None:
    a, b = trio.testing.memory_stream_pair()
    now = trio.current_time()
    got: dict[str, bytes] = {}

    async def side(name: str, stream: trio.abc.Stream, hs: AuthHandshake) -> None:
        got[name] = await _authenticate(stream, hs)

    async with trio.open_nursery() as n:
        n.start_soon(side, "i", a, AuthHandshake(AuthRole.INITIATOR, KEY, CTX, now=now))
        n.start_soon(side, "r", b, AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=now))
    assert got == {"i": b"", "r": b""}
    await a.send_all(b"payload")
    assert await b.receive_some(100) == b"payload"


async def test_over_a_stream_pair_wrong_secret() -> None:
    a, b = trio.testing.memory_stream_pair()
    now = trio.current_time()
    errors: list[str] = []

    async def side(stream: trio.abc.Stream, hs: AuthHandshake) -> None:
        try:
            await _authenticate(stream, hs)
        except AuthError as exc:
            errors.append(str(exc))

    bad = b"not-the-secret-but-long-enough-xx"
    async with trio.open_nursery() as n:
        n.start_soon(side, a, AuthHandshake(AuthRole.INITIATOR, bad, CTX, now=now))
        n.start_soon(side, b, AuthHandshake(AuthRole.RESPONDER, KEY, CTX, now=now))
    assert len(errors) == 2
