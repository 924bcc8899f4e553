"""Which UCX transports an endpoint uses: ``ucp_ep_query`` through ctypes.

ucxx's Python layer does not expose ``ucp_ep_query``, but its endpoints give
their ``ucp_ep_h`` (``UCXEndpoint.handle``), and libucp is loaded from the
``libucx`` wheel (or the system) by ucxx itself. The structures below follow
``ucp/api/ucp.h`` and ``ucp_def.h`` of UCX 1.21 (``ucp_ep_attr_t``,
``ucp_transports_t``, ``ucp_transport_entry_t``); ``entry_size`` makes the
entry array forward compatible, and the fields before ``transports`` have
been fixed since UCX 1.11.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

__all__ = ["endpoint_transports"]

K_EP_ATTR_FIELD_TRANSPORTS = 1 << 3  # UCP_EP_ATTR_FIELD_TRANSPORTS
K_ENTITY_NAME_MAX = 32  # UCP_ENTITY_NAME_MAX
K_SOCKADDR_STORAGE = 128  # sizeof(struct sockaddr_storage) on Linux
K_MAX_LANES = 16  # more than UCP_MAX_LANES (8)


class _Entry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [
        ("entries", ctypes.POINTER(_Entry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    ]


class _EpAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * K_ENTITY_NAME_MAX),
        ("local_sockaddr", ctypes.c_byte * K_SOCKADDR_STORAGE),
        ("remote_sockaddr", ctypes.c_byte * K_SOCKADDR_STORAGE),
        ("transports", _Transports),
        ("user_data", ctypes.c_void_p),
    ]


_query: Any = None  # ucp_ep_query, resolved once (False: not found)


def _ucp_ep_query() -> Any:
    global _query
    if _query is None:
        _query = False
        candidates = []
        try:
            import libucx  # type: ignore[import-untyped]  # the wheel ucxx loads UCX from

            candidates.append(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))
        except ImportError:
            pass
        candidates.append("libucp.so.0")
        for so in candidates:
            try:
                fn = ctypes.CDLL(so).ucp_ep_query
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
            fn.restype = ctypes.c_int
            _query = fn
            break
    return _query or None


def endpoint_transports(ep: Any) -> tuple[str, ...]:
    """The ``transport/device`` pairs of a ucxx endpoint's lanes, e.g. ``("tcp/eth0",)``.

    Empty if the endpoint is gone or libucp has no ``ucp_ep_query`` (UCX < 1.11).
    The pairs come in lane order, duplicates removed (a lane per protocol may
    share a transport).
    """
    query = _ucp_ep_query()
    handle = getattr(ep, "handle", None)
    if query is None or not handle:
        return ()
    entries = (_Entry * K_MAX_LANES)()
    attr = _EpAttr()
    attr.field_mask = K_EP_ATTR_FIELD_TRANSPORTS
    attr.transports.entries = entries
    attr.transports.num_entries = K_MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(_Entry)
    if query(handle, ctypes.byref(attr)) != 0:  # UCS_OK
        return ()
    out: dict[str, None] = {}
    for e in entries[: min(attr.transports.num_entries, K_MAX_LANES)]:
        tl = (e.transport_name or b"?").decode(errors="replace")
        dev = (e.device_name or b"?").decode(errors="replace")
        out[f"{tl}/{dev}"] = None
    return tuple(out)
