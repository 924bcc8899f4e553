"""The sender's session with its receiver: joining (HELLO, the handshake,
ACCEPT) and what the sender's parts share about the session.

The sender's HELLO carries its CHALLENGE (with a secret) and its worker
address; the receiver answers CHALLENGE + PROOF, the sender checks it, derives
the session's tags, listens on its session inbox and sends its PROOF; the
receiver's ACCEPT names the UCX worker it made for this session, to which
everything else goes (see :mod:`._rx_admission` for the receiver's side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from ..._errors import AuthError, PddnetError, PeerUnavailable
from ...wire._auth import AuthHandshake, AuthRole
from ._auth import (
    K_TAG_CTRL_RX,
    K_TAG_CTRL_TX,
    challenge_nonce,
    legacy_tags,
    session_tags,
    ucx_auth_context,
)
from ._messages import K_HELLO_AUTH, K_HELLO_ERRH, Ctl, pack
from ._service import Inbox, UcxService
from ._worker import detects_dead_peers

__all__ = ["Joiner", "TxSession"]

# The receiver's messages once admitted: (kind, transfer id, code, blob).
ReplyHandler = Callable[[Ctl, int, int, bytes], None]


class TxSession:
    """The sender's session with one receiver: its id, tags and endpoints."""

    __slots__ = (
        "data_ep",
        "ep",
        "error_handling",
        "halted_error",
        "open_ok",
        "peer",
        "sender_id",
        "tags",
    )

    def __init__(self, sender_id: int, peer: str) -> None:
        self.sender_id = sender_id
        self.peer = peer  # the receiver's address (without a grant's suffix)
        self.tags = legacy_tags(sender_id)
        self.ep: Any = None  # to the receiver's public worker (HELLO, the handshake)
        self.data_ep: Any = None  # to our session's worker there (everything else)
        self.open_ok = False  # admitted by the receiver
        self.error_handling = False  # decided when joining: see detects_dead_peers
        self.halted_error = ""  # why the receiver halted our session (then start() raises)


class Joiner:
    """Joins the receiver and routes its later messages to ``on_reply``.

    Args:
        service: the sender's UCX end.
        session: filled in as the join goes.
        peer_address: the receiver's public worker address.
        error_handling: ask UCX for peer-failure handling (None: when the
            transports can detect a dead peer).
        on_reply: the receiver's DONE and CANCEL messages, once admitted.
    """

    def __init__(
        self,
        service: UcxService,
        session: TxSession,
        peer_address: bytes,
        error_handling: bool | None,
        on_reply: ReplyHandler,
    ) -> None:
        self._svc = service
        self._s = session
        self._peer_address = peer_address
        self._want_errh = error_handling
        self._on_reply = on_reply
        self._hs: AuthHandshake | None = None
        self._n_i = b""
        self._admitted = trio.Event()
        self._auth_error: PddnetError | None = None
        self._public: Inbox | None = None

    async def join(self) -> None:
        """HELLO (with our CHALLENGE), the handshake, and the receiver's ACCEPT.

        Raises:
            AuthError: if authentication fails or is not finished within the
                auth timeout.
            PeerUnavailable: if a receiver without a secret does not answer in
                time, or its session worker cannot be reached.
        """
        svc, s = self._svc, self._s
        sid = s.sender_id
        self._public = svc.listen(K_TAG_CTRL_TX | sid, self._on_public)
        # UCX error handling only where no shared-memory transport is in play
        # (asking for it excludes them): then a dead receiver fails our sends,
        # and our death fails the receiver's receives, at once.
        want = self._want_errh
        s.error_handling = detects_dead_peers(svc.worker.tls) if want is None else want
        s.ep = svc.worker.connect(self._peer_address, error_handling=s.error_handling)
        address = svc.worker.address
        flags = K_HELLO_ERRH if s.error_handling else 0
        if svc.secret is not None:
            self._hs = AuthHandshake(
                AuthRole.INITIATOR,
                svc.secret,
                ucx_auth_context(sid),
                now=trio.current_time(),
                timeout=svc.auth_timeout,
            )
            first = self._hs.data_to_send()
            self._n_i = challenge_nonce(first)
            hello = pack(Ctl.HELLO, sid, 0, flags | K_HELLO_AUTH, first + address)
        else:
            hello = pack(Ctl.HELLO, sid, 0, flags, address)
        svc.send_ctrl(s.ep, K_TAG_CTRL_RX, hello)
        with trio.move_on_after(svc.auth_timeout):
            await self._admitted.wait()
        if self._auth_error is not None:
            raise self._auth_error
        if not s.open_ok:
            if svc.secret is not None:
                raise AuthError(
                    f"the UCX receiver did not complete authentication in {svc.auth_timeout} s",
                    peer=s.peer,
                )
            raise PeerUnavailable(
                f"the UCX receiver did not answer in {svc.auth_timeout} s", peer=s.peer
            )

    def _on_public(self, kind: Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """Our public inbox: the receiver's handshake frames (everything without a secret)."""
        secret = self._svc.secret
        if sender != self._s.sender_id or (self._admitted.is_set() and secret is not None):
            return
        if kind is Ctl.AUTH:
            self._on_auth(blob)
        elif secret is None:
            self._on_session(kind, sender, tid, code, blob)

    def _fail(self, exc: PddnetError) -> None:
        self._auth_error = exc
        self._admitted.set()

    def _on_auth(self, blob: bytes) -> None:
        svc, s = self._svc, self._s
        hs = self._hs
        if hs is None:  # we have no secret: the receiver demands one
            exc = AuthError("the UCX receiver requires authentication; no secret given")
            self._fail(AuthError(str(exc), peer=s.peer))
            return
        try:
            hs.receive_data(blob)  # the receiver's CHALLENGE and PROOF
        except AuthError as exc:
            out = hs.data_to_send()  # our FAIL, unless the receiver sent one
            if out:
                svc.send_ctrl(s.ep, K_TAG_CTRL_RX, pack(Ctl.AUTH, s.sender_id, 0, 0, out))
            self._fail(AuthError(str(exc), peer=s.peer))
            return
        if not hs.done:
            return
        # The receiver proved the secret: derive the session, listen on its inbox,
        # then send our PROOF (its ACCEPT comes to the session inbox).
        assert svc.secret is not None
        s.tags = session_tags(svc.secret, self._n_i, challenge_nonce(blob), s.sender_id)
        svc.listen(s.tags.tx_tag, self._on_session)
        msg = pack(Ctl.AUTH, s.sender_id, 0, 0, hs.data_to_send())
        svc.send_ctrl(s.ep, K_TAG_CTRL_RX, msg)

    def _on_session(self, kind: Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """The receiver's messages on our session inbox: ACCEPT, then DONE, CANCEL."""
        s = self._s
        if sender != s.sender_id:
            return
        if kind is Ctl.ACCEPT:
            if not self._admitted.is_set():
                self._on_accept(blob)
            return
        if s.open_ok:
            self._on_reply(kind, tid, code, blob)

    def _on_accept(self, blob: bytes) -> None:
        svc, s = self._svc, self._s
        if blob:  # the receiver's worker for this session: our data go there
            try:
                s.data_ep = svc.worker.connect(blob, error_handling=s.error_handling)
            except PeerUnavailable as exc:
                self._fail(
                    PeerUnavailable(
                        f"cannot reach the receiver's session worker: {exc}", peer=s.peer
                    )
                )
                return
        else:  # one worker for all senders there
            s.data_ep = s.ep
        s.open_ok = True
        self._admitted.set()
        if svc.secret is not None and self._public is not None:
            svc.unlisten(self._public)  # nothing more comes there
