"""The receiver's admission: HELLO, the challenge-response, and ACCEPT.

**Authentication.** With a shared ``secret`` a sender must pass the data-plane
challenge-response (:class:`pddnet.wire.AuthHandshake`, the WAN streams'
handshake, channel ``local``) before anything else: its HELLO carries its
CHALLENGE, the receiver answers CHALLENGE + PROOF, the sender checks that and
sends its PROOF, the receiver checks it and answers ACCEPT. Both ends then
derive the session's tags from the secret and both nonces (see
:mod:`._auth`): the data tags' mask and two private inboxes. The receiver
posts receives into granted memory only when an authenticated session's START
names the transfer, and only under that session's tags, so a peer that fails
or skips the handshake can never match one (UCX's tag matching does not tell
endpoints apart: unguessable tags are what does). A failed handshake is an
:class:`~pddnet.AuthError` on both sides (the sender's ``__aenter__`` raises;
the receiver counts it in ``statistics().auth_failures`` and keeps the last
ones in :attr:`Admission.auth_errors`).

Without a secret the receiver's public inbox carries everything, and the
session's tags are the legacy ones (mask 0).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import trio

from ..._errors import AuthError, PeerUnavailable
from ...wire._auth import K_AUTH_FRAME_SIZE, AuthFrame, AuthHandshake, AuthKind, AuthRole
from ._auth import (
    K_TAG_CTRL_RX,
    K_TAG_CTRL_TX,
    SessionTags,
    challenge_nonce,
    legacy_tags,
    session_tags,
    ucx_auth_context,
)
from ._messages import K_HELLO_AUTH, K_HELLO_ERRH, Ctl, pack
from ._rx_sessions import SessionHandler, SessionTable
from ._service import Inbox, UcxService

__all__ = ["Admission"]

log = logging.getLogger("pddnet.transport.local")

K_MAX_PENDING_AUTH = 64  # handshakes in progress on a receiver (more are dropped)
K_KEEP_AUTH_ERRORS = 16


class _Pending:
    """A handshake in progress on the receiver."""

    __slots__ = ("address", "ep", "errh", "hs", "n_i", "n_r", "scope")

    def __init__(
        self,
        hs: AuthHandshake,
        ep: Any,
        n_i: bytes,
        n_r: bytes,
        errh: bool = False,
        address: bytes = b"",
    ) -> None:
        self.hs = hs
        self.ep = ep
        self.n_i = n_i
        self.n_r = n_r
        self.errh = errh
        self.address = address  # the sender's worker address (its HELLO)
        self.scope = trio.CancelScope()


class Admission:
    """The receiver's public inbox: senders' HELLOs and handshakes, up to ACCEPT.

    Args:
        service: the receiver's UCX end (its secret and auth timeout).
        sessions: where admitted senders go.
        on_message: a session's control messages; without a secret they may
            come to the public inbox too.
    """

    def __init__(
        self, service: UcxService, sessions: SessionTable, on_message: SessionHandler
    ) -> None:
        self._svc = service
        self._sessions = sessions
        self._on_message = on_message
        self._pending: dict[int, _Pending] = {}
        self.auth_failures = 0
        self.auth_errors: deque[AuthError] = deque(maxlen=K_KEEP_AUTH_ERRORS)
        self.unauthenticated = 0  # control messages from no admitted sender

    def listen(self) -> Inbox:
        """Start listening on the receiver's public inbox."""
        return self._svc.listen(K_TAG_CTRL_RX, self._on_public)

    def _on_public(self, kind: Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """The public inbox: HELLO and handshake frames; everything else only without a secret."""
        if kind is Ctl.HELLO:
            self.on_hello(sender, code, blob)
        elif kind is Ctl.AUTH:
            self._on_auth(sender, blob)
        elif (
            self._svc.secret is None
            and (s := self._sessions.live.get(sender)) is not None
            and s.worker is self._svc.worker  # else: only to its own worker
        ):
            self._on_message(s, kind, sender, tid, code, blob)
        else:
            self.unauthenticated += 1
            log.debug("dropping an unauthenticated UCX %s from %08x", kind.name, sender)

    def _auth_failed(self, sender: int, exc: AuthError) -> None:
        self.auth_failures += 1
        self.auth_errors.append(exc)
        level = logging.WARNING if self.auth_failures == 1 else logging.DEBUG
        log.log(level, "dropping UCX sender %08x: %s", sender, exc)

    def _reject(self, sender: int, ep: Any, exc: AuthError, out: bytes) -> None:
        """Fail a sender's admission: tell it (a FAIL frame) if we can, and count it."""
        if ep is not None and out:
            self._svc.send_ctrl(ep, K_TAG_CTRL_TX | sender, pack(Ctl.AUTH, sender, 0, 0, out))
        if ep is not None:  # not used again: its close flushes the FAIL first
            self._svc.worker.close_endpoint(ep)
        self._auth_failed(sender, AuthError(str(exc), peer=f"ucx-sender-{sender:08x}"))

    def on_hello(self, sender: int, code: int, blob: bytes) -> None:
        """A sender's HELLO: admit it (no secret) or start the handshake."""
        if sender in self._sessions.live or sender in self._pending:
            self.unauthenticated += 1  # a duplicate (or a spoofed id): the first one stands
            return
        wants_auth = bool(code & K_HELLO_AUTH)
        errh = bool(code & K_HELLO_ERRH)
        frame, address = b"", blob
        if wants_auth:
            frame, address = blob[:K_AUTH_FRAME_SIZE], blob[K_AUTH_FRAME_SIZE:]
        if not address:
            self._auth_failed(sender, AuthError("malformed HELLO: no worker address"))
            return
        secret = self._svc.secret
        if secret is not None and len(self._pending) >= K_MAX_PENDING_AUTH:
            self._auth_failed(sender, AuthError("too many UCX handshakes in progress"))
            return
        try:
            # The same error-handling mode as the sender's endpoint: UCX never
            # delivered between endpoints whose modes differ (measured).
            ep = self._svc.worker.connect(address, error_handling=errh)
        except PeerUnavailable as exc:
            log.warning("cannot reach UCX sender %08x: %s", sender, exc)
            return
        fail = AuthFrame(AuthKind.FAIL).encode()
        if secret is None:
            if wants_auth:
                err = AuthError("the sender asked to authenticate; this receiver has no secret")
                self._reject(sender, ep, err, fail)
            else:
                self._admit(sender, ep, legacy_tags(sender), errh, address)
            return
        if not wants_auth:
            self._reject(sender, ep, AuthError("the sender skipped authentication"), fail)
            return
        hs = AuthHandshake(
            AuthRole.RESPONDER,
            secret,
            ucx_auth_context(sender),
            now=trio.current_time(),
            timeout=self._svc.auth_timeout,
        )
        mine = hs.data_to_send()  # our CHALLENGE
        try:
            hs.receive_data(frame)
            n_i = challenge_nonce(frame)
        except AuthError as exc:
            self._reject(sender, ep, exc, hs.data_to_send() or fail)
            return
        p = _Pending(hs, ep, n_i, challenge_nonce(mine), errh, address)
        self._pending[sender] = p
        msg = pack(Ctl.AUTH, sender, 0, 0, mine + hs.data_to_send())
        self._svc.send_ctrl(ep, K_TAG_CTRL_TX | sender, msg)
        self._svc.nursery.start_soon(self._auth_deadline, sender, p)

    def _on_auth(self, sender: int, blob: bytes) -> None:
        p = self._pending.get(sender)
        if p is None:  # no handshake with this sender (or it ended): ignore
            self.unauthenticated += 1
            return
        try:
            p.hs.receive_data(blob)
        except AuthError as exc:
            del self._pending[sender]
            p.scope.cancel()
            self._reject(sender, p.ep, exc, p.hs.data_to_send())
            return
        if not p.hs.done:
            return
        del self._pending[sender]
        p.scope.cancel()
        assert self._svc.secret is not None
        tags = session_tags(self._svc.secret, p.n_i, p.n_r, sender)
        if tags.rx_tag in self._sessions.rx_tags or p.hs.leftover:  # ~2**-60, or junk after PROOF
            err = AuthError("unusable UCX session (tag collision or trailing bytes)")
            self._reject(sender, p.ep, err, AuthFrame(AuthKind.FAIL).encode())
            return
        self._admit(sender, p.ep, tags, p.errh, p.address)

    def _admit(
        self, sender: int, ep: Any, tags: SessionTags, errh: bool = False, address: bytes = b""
    ) -> None:
        if not self._sessions.make_room():
            exc = AuthError(
                f"{self._sessions.bound} UCX sender sessions are busy; admission refused"
            )
            self._reject(sender, ep, exc, AuthFrame(AuthKind.FAIL).encode())
            return
        self._sessions.add(sender, ep, tags, errh, address)

    async def _auth_deadline(self, sender: int, p: _Pending) -> None:
        with p.scope:
            deadline = p.hs.get_timer()
            await trio.sleep_until(deadline if deadline is not None else trio.current_time())
            if self._pending.get(sender) is p:
                del self._pending[sender]
                try:
                    p.hs.handle_timer(trio.current_time())
                except AuthError as exc:
                    self._reject(sender, p.ep, exc, p.hs.data_to_send())

    def close_pending(self) -> list[int]:
        """Stop every handshake in progress and start closing its endpoint; the
        closes (public worker's handles) still in flight."""
        closing = []
        for p in self._pending.values():
            p.scope.cancel()
            if p.ep is not None:
                closing.append(self._svc.worker.close_endpoint(p.ep))
                p.ep = None
        return closing
