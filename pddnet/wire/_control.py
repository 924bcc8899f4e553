"""Control-plane messages: versioned msgpack, schema-checked, HMAC-authenticated.

A control frame is ``tag || body`` where ``body`` is a msgpack array::

    [version, type_id, kind, seq, corr, field_1, ..., field_n]

and ``tag`` is the first 16 bytes of HMAC-SHA256(key, src || 0 || dst || 0 || body).
Sender and recipient names are bound into the MAC but not sent (the socket
knows them), so a frame replayed to another node, or claimed by another
sender, fails authentication. ``seq`` is the sender's nanosecond clock, made
strictly increasing; the receiving node (``pddnet.control``'s ``PathGuard``)
rejects anything not newer than the last frame from that sender on that
connection, or outside a time window.

Message types are frozen dataclasses registered with :func:`message`. Their
field annotations are the schema: ``int``, ``float``, ``bool``, ``str``,
``bytes``, ``list[int]``, ``list[str]``, ``list[bytes]`` and ``X | None``.
Decoding checks every field's type and size; anything else is a
:class:`RemoteProtocolError`. See docs/wire.md for the type-id table.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, dataclass_transform

import msgpack

from .._errors import AuthError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "K_CONTROL_VERSION",
    "K_TAG_SIZE",
    "ControlLimits",
    "Frame",
    "FrameKind",
    "Message",
    "SeqClock",
    "decode_frame",
    "encode_frame",
    "message",
    "registered_messages",
]

K_CONTROL_VERSION = 1
K_TAG_SIZE = 16  # HMAC-SHA256 truncated to 128 bits (RFC 4868 style)
_I64_MAX = (1 << 63) - 1
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ControlLimits:
    """Bounds every decoder enforces before allocating.

    Args:
        max_message_bytes: largest frame accepted, tag included.
        max_tokens: most token ids one message may carry.
        max_ranges: most ranges (or list items) one message may carry.
        max_str: longest string field, in bytes.
        max_bytes: longest bytes field.
    """

    max_message_bytes: int = 1 << 20
    max_tokens: int = 8192
    max_ranges: int = 65536
    max_str: int = 1024
    max_bytes: int = 1 << 20


class FrameKind(enum.IntEnum):
    EVENT = 0
    REQUEST = 1
    REPLY = 2


class Message:
    """Base of every control message. Subclasses are frozen slotted dataclasses."""

    TYPE_ID: ClassVar[int]
    _CHECKERS: ClassVar[tuple[tuple[str, Callable[[Any, ControlLimits], bool]], ...]]


M = TypeVar("M", bound=type[Message])
_REGISTRY: dict[int, type[Message]] = {}


def _checker(tp: Any, field: str) -> Callable[[Any, ControlLimits], bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union in field {field}")
        inner = _checker(args[0], field)
        return lambda v, lim: v is None or inner(v, lim)
    if tp is int:
        return lambda v, lim: type(v) is int and -_I64_MAX <= v <= _U64_MAX
    if tp is float:
        return lambda v, lim: type(v) in (float, int) and not isinstance(v, bool)
    if tp is bool:
        return lambda v, lim: type(v) is bool
    if tp is str:
        return lambda v, lim: type(v) is str and len(v) <= lim.max_str
    if tp is bytes:
        return lambda v, lim: type(v) is bytes and len(v) <= lim.max_bytes
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _checker(item_tp, field)
        return lambda v, lim: (
            type(v) is list and len(v) <= lim.max_ranges and all(item(x, lim) for x in v)
        )
    raise TypeError(f"unsupported type {tp!r} for control message field {field}")


@dataclass_transform(frozen_default=True)
def message(type_id: int) -> Callable[[M], M]:
    """Class decorator: register a control message type under ``type_id``.

    The class becomes a frozen, slotted dataclass; its annotations are the schema.
    """

    def wrap(cls: M) -> M:
        if not 0 <= type_id < 256:
            raise ValueError("control type ids are one byte")
        if type_id in _REGISTRY:
            raise ValueError(f"control type id {type_id} already used by {_REGISTRY[type_id]}")
        dc: Any = dataclass(frozen=True, slots=True)(cls)
        hints = typing.get_type_hints(dc)
        dc.TYPE_ID = type_id
        dc._CHECKERS = tuple(
            (f.name, _checker(hints[f.name], f.name)) for f in dataclasses.fields(dc)
        )
        _REGISTRY[type_id] = dc
        return typing.cast(M, dc)

    return wrap


def registered_messages() -> dict[int, type[Message]]:
    """A copy of the type-id registry."""
    return dict(_REGISTRY)


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded control frame."""

    kind: FrameKind
    seq: int
    corr: int
    message: Message


_DEFAULT_LIMITS = ControlLimits()
_MAC_BASES: dict[bytes, Any] = {}


def _tag(key: bytes, src: str, dst: str, body: bytes) -> bytes:
    # Copying a keyed HMAC object skips re-deriving the inner and outer pads.
    base = _MAC_BASES.get(key)
    if base is None:
        if len(_MAC_BASES) > 64:
            _MAC_BASES.clear()
        base = _MAC_BASES[key] = hmac.new(key, digestmod=hashlib.sha256)
    mac = base.copy()
    mac.update(f"{src}\0{dst}\0".encode())
    mac.update(body)
    return mac.digest()[:K_TAG_SIZE]


def encode_frame(
    msg: Message,
    *,
    key: bytes,
    src: str,
    dst: str,
    seq: int,
    corr: int = 0,
    kind: FrameKind = FrameKind.EVENT,
    limits: ControlLimits | None = None,
) -> bytes:
    """Encode and authenticate one control message.

    Raises:
        LocalProtocolError: if the message is unregistered, fails its own schema,
            or encodes larger than ``limits.max_message_bytes``.
    """
    limits = limits or _DEFAULT_LIMITS
    cls = type(msg)
    if _REGISTRY.get(getattr(cls, "TYPE_ID", -1)) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered control message")
    values = [getattr(msg, name) for name, _ in cls._CHECKERS]
    for (name, check), value in zip(cls._CHECKERS, values, strict=True):
        if not check(value, limits):
            raise LocalProtocolError(f"{cls.__name__}.{name} violates its schema: {value!r:.80}")
    body = msgpack.packb(
        [K_CONTROL_VERSION, cls.TYPE_ID, int(kind), seq, corr, *values], use_bin_type=True
    )
    frame = _tag(key, src, dst, body) + body
    if len(frame) > limits.max_message_bytes:
        raise LocalProtocolError(
            f"{cls.__name__} encodes to {len(frame)} bytes, over {limits.max_message_bytes}"
        )
    return frame


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} not allowed")


def decode_frame(
    data: bytes, *, key: bytes, src: str, dst: str, limits: ControlLimits | None = None
) -> Frame:
    """Authenticate and decode one control frame. Pure: no replay state.

    Raises:
        AuthError: if the tag does not verify (forged, tampered, wrong peer).
        RemoteProtocolError: if the frame is oversized, malformed, of another
            version or an unknown type, or breaks its schema.
    """
    limits = limits or _DEFAULT_LIMITS
    if len(data) > limits.max_message_bytes:
        raise RemoteProtocolError(f"control frame of {len(data)} bytes over the limit", peer=src)
    if len(data) <= K_TAG_SIZE:
        raise RemoteProtocolError("control frame too short", peer=src)
    tag, body = data[:K_TAG_SIZE], data[K_TAG_SIZE:]
    if not hmac.compare_digest(tag, _tag(key, src, dst, body)):
        raise AuthError("control frame failed authentication", peer=src)
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_str,
            max_bin_len=max(limits.max_bytes, 5 * limits.max_tokens),
            max_array_len=limits.max_ranges,
            max_map_len=0,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except Exception as exc:  # msgpack raises many types; all mean "malformed"
        raise RemoteProtocolError(f"malformed control frame: {exc}", peer=src) from exc
    if type(obj) is not list or len(obj) < 5:
        raise RemoteProtocolError("control frame is not an envelope array", peer=src)
    version, type_id, kind, seq, corr, *values = obj
    if version != K_CONTROL_VERSION:
        raise RemoteProtocolError(f"unsupported control version {version!r}", peer=src)
    cls = _REGISTRY.get(type_id) if type(type_id) is int else None
    if cls is None:
        raise RemoteProtocolError(f"unknown control message type {type_id!r}", peer=src)
    if kind not in (0, 1, 2) or type(seq) is not int or type(corr) is not int:
        raise RemoteProtocolError("bad control envelope", peer=src)
    if not (0 <= seq <= _U64_MAX and 0 <= corr <= _U64_MAX):
        raise RemoteProtocolError("control envelope field out of range", peer=src)
    if len(values) != len(cls._CHECKERS):
        raise RemoteProtocolError(
            f"{cls.__name__} wants {len(cls._CHECKERS)} fields, got {len(values)}", peer=src
        )
    for (name, check), value in zip(cls._CHECKERS, values, strict=True):
        if not check(value, limits):
            raise RemoteProtocolError(f"{cls.__name__}.{name} violates its schema", peer=src)
    return Frame(FrameKind(kind), seq, corr, cls(*values))


class SeqClock:
    """Strictly increasing nanosecond sequence numbers for outgoing frames."""

    def __init__(self) -> None:
        self._last = 0

    def next(self) -> int:
        self._last = max(self._last + 1, time.time_ns())
        return self._last
