"""Challenge-response authentication of a data connection (sans-IO).

Theory of operation
-------------------
Before a data connection (WAN stream or local path) carries a single chunk,
both ends prove that they hold the shared secret, without sending it and
without anything an eavesdropper could replay. Each side::

    1. sends CHALLENGE(nonce_self)               (32 random bytes, fresh per connection)
    2. on the peer's CHALLENGE, sends PROOF(tag_self)
    3. on the peer's PROOF, checks it in constant time -> DONE (or AuthError)

where ``tag_R = HMAC-SHA256(K, "pddnet-data-auth/1" 0 R 0 n_I n_R len(ctx) ctx)``
for the prover's role ``R`` (``initiator``/``responder``), the initiator's and
responder's nonces ``n_I``/``n_R``, and a *transfer-independent* context
``ctx`` both ends know in advance (the channel and the two node names, see
:func:`auth_context`). ``K`` is derived from the shared secret with its own
label, so a data-plane tag is never a valid control-plane tag.

Why it holds:

* **Replay.** Every tag covers both nonces; a recorded proof is worthless on a
  new connection because the verifier chose a fresh nonce.
* **Reflection.** The prover's role is inside the MAC, so an attacker who
  echoes our own CHALLENGE and PROOF back at us fails: we expect the *other*
  role's tag. A CHALLENGE that carries our own nonce is refused outright.
* **Mix-ups.** The context binds the channel and both names, so a proof made
  for P->MD on the WAN does not verify for P->RLD on the local path.
* **Resource use.** Frames are fixed-size (40 bytes, one read like a chunk
  header); at most two frames are read before the verdict, so a peer cannot
  make us buffer more than 80 bytes; a deadline (``get_timer``/
  ``handle_timer``) bounds a silent peer (slowloris).
* **Order.** Nothing after the peer's PROOF is interpreted here: it is
  returned as :attr:`AuthHandshake.leftover` for the data path, which may only
  use it once :attr:`AuthHandshake.state` is ``DONE``.

Both ends may send their CHALLENGE at once: the exchange takes one round trip.
On failure the machine emits a FAIL frame (so an honest peer with the wrong
secret gets a typed :class:`~pddnet.AuthError` rather than a bare EOF) and the
state is ``FAILED`` for good; the driver then closes the connection.

Wire format of every frame (40 bytes)::

    offset size field
    0      4    magic  b"PDDA"
    4      1    version (1)
    5      1    kind    (AuthKind: CHALLENGE 1, PROOF 2, FAIL 3)
    6      2    reserved, 0
    8      32   nonce (CHALLENGE) / tag (PROOF) / zeros (FAIL)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import struct
from dataclasses import dataclass

from .._errors import AuthError, LocalProtocolError

__all__ = [
    "K_AUTH_FRAME_SIZE",
    "K_AUTH_MAGIC",
    "K_AUTH_MAX_CONTEXT",
    "K_AUTH_NONCE_SIZE",
    "AuthFrame",
    "AuthHandshake",
    "AuthKind",
    "AuthRole",
    "AuthState",
    "auth_context",
]

log = logging.getLogger("pddnet.wire.auth")

K_AUTH_MAGIC = b"PDDA"
K_AUTH_VERSION = 1
K_AUTH_NONCE_SIZE = 32
K_AUTH_MAX_CONTEXT = 256
K_AUTH_MIN_SECRET = 16  # as the control plane's secret (pddnet.control._secret)
_LABEL = b"pddnet-data-auth/1"
_FRAME = struct.Struct("<4sBBH32s")
K_AUTH_FRAME_SIZE = _FRAME.size  # 40, the chunk header's size: one fixed read
_ZERO = bytes(K_AUTH_NONCE_SIZE)


class AuthKind(enum.IntEnum):
    CHALLENGE = 1
    PROOF = 2
    FAIL = 3


class AuthRole(enum.Enum):
    INITIATOR = "initiator"  # the side that connected
    RESPONDER = "responder"  # the side that accepted

    @property
    def peer(self) -> AuthRole:
        return AuthRole.RESPONDER if self is AuthRole.INITIATOR else AuthRole.INITIATOR


class AuthState(enum.Enum):
    CHALLENGED = enum.auto()  # our CHALLENGE is out; waiting for the peer's
    PROVED = enum.auto()  # our PROOF is out; waiting for the peer's
    DONE = enum.auto()  # the peer proved the secret
    FAILED = enum.auto()  # sticky


# The transition table: (state, frame kind received) -> next state. Anything
# else is a protocol violation and fails the handshake.
_TRANSITIONS: dict[tuple[AuthState, AuthKind], AuthState] = {
    (AuthState.CHALLENGED, AuthKind.CHALLENGE): AuthState.PROVED,
    (AuthState.PROVED, AuthKind.PROOF): AuthState.DONE,
}


@dataclass(frozen=True, slots=True)
class AuthFrame:
    """One handshake frame."""

    kind: AuthKind
    payload: bytes = _ZERO

    def encode(self) -> bytes:
        return _FRAME.pack(K_AUTH_MAGIC, K_AUTH_VERSION, self.kind, 0, self.payload)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> AuthFrame:
        """Parse exactly one frame.

        Raises:
            AuthError: on a wrong size, magic, version, kind or reserved field.
        """
        if len(data) != K_AUTH_FRAME_SIZE:
            raise AuthError(f"auth frame is {K_AUTH_FRAME_SIZE} bytes, got {len(data)}")
        magic, version, kind, reserved, payload = _FRAME.unpack(bytes(data))
        if magic != K_AUTH_MAGIC:
            raise AuthError(f"bad auth frame magic {magic!r}: the peer did not authenticate")
        if version != K_AUTH_VERSION or reserved:
            raise AuthError(f"unsupported auth frame version {version}")
        try:
            kind_e = AuthKind(kind)
        except ValueError as exc:
            raise AuthError(f"bad auth frame kind {kind}") from exc
        return cls(kind_e, payload)


def auth_context(channel: str, initiator: str, responder: str) -> bytes:
    """The transfer-independent context both ends bind into their proofs.

    Args:
        channel: which data path, e.g. ``"wan"`` or ``"local"``.
        initiator: the connecting node's name.
        responder: the accepting node's name.

    Returns:
        At most :data:`K_AUTH_MAX_CONTEXT` bytes.

    Raises:
        LocalProtocolError: if a part holds a NUL or the result is too long.
    """
    parts = [channel, initiator, responder]
    if any("\0" in p for p in parts):
        raise LocalProtocolError("auth context parts may not contain NUL")
    ctx = "\0".join(parts).encode()
    if len(ctx) > K_AUTH_MAX_CONTEXT:
        raise LocalProtocolError(f"auth context of {len(ctx)} bytes over {K_AUTH_MAX_CONTEXT}")
    return ctx


def _derive(secret: bytes) -> bytes:
    return hmac.new(secret, _LABEL + b"\0key", hashlib.sha256).digest()


class AuthHandshake:
    """One end of the handshake. Feed it bytes; send what it returns.

    Args:
        role: ``INITIATOR`` for the connecting side, ``RESPONDER`` for the acceptor.
        secret: the shared secret (at least 16 bytes).
        context: transfer-independent context, see :func:`auth_context`.
        now: the current time (any monotonic clock), for the deadline.
        timeout: seconds the peer has to complete the handshake.
        nonce: our nonce; random unless given (tests only).

    Raises:
        AuthError: if the secret is too short.
        LocalProtocolError: if the context is too long or the nonce malformed.
    """

    def __init__(
        self,
        role: AuthRole,
        secret: bytes,
        context: bytes,
        *,
        now: float,
        timeout: float = 10.0,
        nonce: bytes | None = None,
    ) -> None:
        if len(secret) < K_AUTH_MIN_SECRET:
            raise AuthError(f"the data-plane secret must be at least {K_AUTH_MIN_SECRET} bytes")
        if len(context) > K_AUTH_MAX_CONTEXT:
            raise LocalProtocolError(f"auth context over {K_AUTH_MAX_CONTEXT} bytes")
        nonce = secrets.token_bytes(K_AUTH_NONCE_SIZE) if nonce is None else nonce
        if len(nonce) != K_AUTH_NONCE_SIZE:
            raise LocalProtocolError(f"an auth nonce is {K_AUTH_NONCE_SIZE} bytes")
        self.role = role
        self._key = _derive(secret)
        self._context = context
        self._nonce = nonce
        self._peer_nonce: bytes | None = None
        self._deadline = now + timeout
        self._buf = bytearray()
        self._out = bytearray(AuthFrame(AuthKind.CHALLENGE, nonce).encode())
        self.state = AuthState.CHALLENGED
        self.error: AuthError | None = None
        self.leftover = b""

    # ------------------------------------------------------------ machine
    def _set_state(self, new: AuthState) -> None:
        log.debug("auth %s: %s -> %s", self.role.value, self.state.name, new.name)
        self.state = new

    def _tag(self, role: AuthRole) -> bytes:
        assert self._peer_nonce is not None
        # the initiator's nonce first, whoever proves
        if self.role is AuthRole.INITIATOR:
            n_i, n_r = self._nonce, self._peer_nonce
        else:
            n_i, n_r = self._peer_nonce, self._nonce
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(_LABEL + b"\0" + role.value.encode() + b"\0")
        mac.update(n_i + n_r)
        mac.update(struct.pack("<H", len(self._context)) + self._context)
        return mac.digest()

    def _fail(self, exc: AuthError, *, notify: bool = True) -> AuthError:
        if self.state is not AuthState.FAILED:
            self._set_state(AuthState.FAILED)
            self.error = exc
            self._out.clear()
            if notify:
                self._out += AuthFrame(AuthKind.FAIL).encode()
        return exc

    def _on_frame(self, frame: AuthFrame) -> None:
        if frame.kind is AuthKind.FAIL:
            raise self._fail(AuthError("the peer rejected our authentication"), notify=False)
        nxt = _TRANSITIONS.get((self.state, frame.kind))
        if nxt is None:
            raise self._fail(AuthError(f"can't handle auth {frame.kind.name} in {self.state.name}"))
        if frame.kind is AuthKind.CHALLENGE:
            if hmac.compare_digest(frame.payload, self._nonce):
                raise self._fail(AuthError("the peer reflected our challenge"))
            self._peer_nonce = frame.payload
            self._out += AuthFrame(AuthKind.PROOF, self._tag(self.role)).encode()
        elif not hmac.compare_digest(frame.payload, self._tag(self.role.peer)):
            raise self._fail(AuthError("the peer's proof does not verify (wrong secret?)"))
        self._set_state(nxt)

    # ------------------------------------------------------------ API
    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes from the connection.

        Bytes after the peer's PROOF are kept in :attr:`leftover`, uninterpreted.

        Raises:
            AuthError: on any malformed, unexpected or unverifiable frame, or a
                FAIL from the peer; the state becomes ``FAILED`` and
                :meth:`data_to_send` holds a FAIL frame for the peer.
            LocalProtocolError: if called after ``DONE`` or ``FAILED``.
        """
        if self.state in (AuthState.DONE, AuthState.FAILED):
            raise LocalProtocolError(f"auth handshake already {self.state.name}")
        self._buf += data
        while len(self._buf) >= K_AUTH_FRAME_SIZE and self.state is not AuthState.DONE:
            raw = bytes(self._buf[:K_AUTH_FRAME_SIZE])
            del self._buf[:K_AUTH_FRAME_SIZE]
            try:
                frame = AuthFrame.decode(raw)
            except AuthError as exc:
                raise self._fail(exc) from None
            self._on_frame(frame)
        if self.state is AuthState.DONE:
            self.leftover = bytes(self._buf)
            self._buf.clear()

    def data_to_send(self) -> bytes:
        """Bytes to write to the connection now (possibly empty)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def bytes_wanted(self) -> int:
        """How many more bytes the machine needs before its next step (0 when done).

        A driver may read exactly this many, so nothing past the handshake is
        consumed from the socket.
        """
        if self.state in (AuthState.DONE, AuthState.FAILED):
            return 0
        return K_AUTH_FRAME_SIZE - len(self._buf)

    def get_timer(self) -> float | None:
        """The deadline by which the peer must finish, or None when settled."""
        if self.state in (AuthState.DONE, AuthState.FAILED):
            return None
        return self._deadline

    def handle_timer(self, now: float) -> None:
        """Fail the handshake if its deadline passed.

        Raises:
            AuthError: if ``now`` is at or past the deadline and we are not done.
        """
        timer = self.get_timer()
        if timer is not None and now >= timer:
            raise self._fail(AuthError(f"auth handshake timed out in {self.state.name}"))

    @property
    def done(self) -> bool:
        """True once the peer proved it holds the secret."""
        return self.state is AuthState.DONE
