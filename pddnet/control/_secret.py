"""Where the shared control-plane secret comes from, and the CURVE keys it yields."""

from __future__ import annotations

import hashlib
import hmac
import os

import zmq
import zmq.utils.z85

from .._errors import AuthError

__all__ = ["K_CURVE_LABEL", "K_SECRET_ENV", "curve_keys", "load_secret"]

K_SECRET_ENV = "PDDNET_SECRET"
K_MIN_SECRET_BYTES = 16
# Its own label: a CURVE key is never a control-frame tag or a data-plane proof.
K_CURVE_LABEL = b"pddnet-control-curve/1"


def load_secret(secret: bytes | str | None = None) -> bytes:
    """The HMAC key: ``secret`` if given, else ``$PDDNET_SECRET``.

    Raises:
        AuthError: if neither is set, or the secret is shorter than 16 bytes.
    """
    if secret is None:
        secret = os.environ.get(K_SECRET_ENV)
        if not secret:
            raise AuthError(f"no control-plane secret: pass one or set ${K_SECRET_ENV}")
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < K_MIN_SECRET_BYTES:
        raise AuthError(f"the control-plane secret must be at least {K_MIN_SECRET_BYTES} bytes")
    return key


def curve_keys(key: bytes) -> tuple[bytes, bytes]:
    """The CURVE key pair (public, secret; Z85) that every holder of ``key`` uses.

    The secret key is ``HMAC-SHA256(key, K_CURVE_LABEL)`` (any 32 bytes are
    an X25519 secret key). Every node holds the same pair, as client and as
    server, so completing zmq's CURVE handshake proves knowledge of ``key``:
    without it a peer cannot compute the server's public key that its HELLO
    must be boxed to, nor open the server's WELCOME.
    """
    secret = zmq.utils.z85.encode(hmac.new(key, K_CURVE_LABEL, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret
