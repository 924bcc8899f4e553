"""Connecting the API test endpoints to each other (in one trio loop)."""

from __future__ import annotations

from typing import Any


async def wire(p: Any, rld: Any, md: Any, user: Any = None) -> None:
    """P <-> each decoder, RLD <-> MD, and the decoders -> ``user`` (a sink node) if given."""
    for ep in (rld, md):
        await p.connect_peer(ep.info())
        await ep.connect_peer(p.info())
        if user is not None:
            await ep.node.connect(user.name, user.address)
    await rld.connect_peer(md.info())
    await md.connect_peer(rld.info())
