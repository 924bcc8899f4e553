"""Where the shared control-plane secret comes from."""

from __future__ import annotations

import os

from .._errors import AuthError

__all__ = ["K_SECRET_ENV", "load_secret"]

K_SECRET_ENV = "PDDNET_SECRET"
K_MIN_SECRET_BYTES = 16


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
