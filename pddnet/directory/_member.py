"""What the directory holds: a member (handshake blob, role, load), its key and value.

A member lives at ``/pddnet/<cluster>/<role>/<name>``; its value is versioned
msgpack ``[version, blob, load]``, where ``blob`` is the endpoint's handshake
blob (:meth:`pddnet.api.EndpointInfo.blob`) and ``load`` a small map of
counters. Anyone who can write to the store can write garbage there, so
:func:`decode_member` bounds every size before it allocates and checks that
the blob's role and name agree with the key it was found under.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgpack

from .._errors import LocalProtocolError, RemoteProtocolError
from ..api import EndpointInfo
from ..api._info import K_MAX_BLOB

__all__ = [
    "DirectoryEvent",
    "Load",
    "Member",
    "MemberJoined",
    "MemberLeft",
    "MemberUpdated",
]

K_DIR_VERSION = 1
K_PREFIX = "/pddnet/"
K_MAX_NAME = 128  # cluster and member names, in characters
K_MAX_LOAD_FIELDS = 16  # a newer writer may add counters; we read the ones we know
K_MAX_VALUE = K_MAX_BLOB + 512  # the blob plus the version and the load map
ROLES = ("prefill", "relay", "main")


@dataclass(frozen=True, slots=True)
class Load:
    """A member's load summary, as the routers read it.

    Args:
        active: requests it is serving now.
        capacity: requests it will serve at once (0: not stated).
        free_blocks: free KV blocks in its pool.
        queued_bytes: bytes queued at its WAN sender, not yet acknowledged.
    """

    active: int = 0
    capacity: int = 0
    free_blocks: int = 0
    queued_bytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or not 0 <= v < 2**63:
                raise LocalProtocolError(f"Load.{f.name} must be an int in [0, 2**63), not {v!r}")


@dataclass(frozen=True, slots=True)
class Member:
    """One registered instance.

    Attributes:
        info: its handshake blob, parsed (``info.role`` and ``info.name`` are
            its role and name in the directory).
        load: its latest load summary.
        revision: the store's revision of this value (etcd's ``mod_revision``;
            a counter in memory): a later value has a larger one.
    """

    info: EndpointInfo
    load: Load
    revision: int

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def name(self) -> str:
        return self.info.name


@dataclass(frozen=True, slots=True)
class MemberJoined:
    """A member registered (or re-registered after it had left)."""

    member: Member


@dataclass(frozen=True, slots=True)
class MemberUpdated:
    """A registered member published a new value (a load update, say)."""

    member: Member


@dataclass(frozen=True, slots=True)
class MemberLeft:
    """A member deregistered, or its lease expired (it died or lost the store)."""

    role: str
    name: str
    revision: int


DirectoryEvent = MemberJoined | MemberUpdated | MemberLeft


def check_name(what: str, name: str) -> None:
    """Refuse a cluster, role or member name that cannot be one key segment.

    Raises:
        LocalProtocolError: if it is empty, too long, or has ``/`` or a
            non-printable character.
    """
    if not name or len(name) > K_MAX_NAME or "/" in name or not name.isprintable():
        raise LocalProtocolError(
            f"{what} {name!r} must be 1-{K_MAX_NAME} printable characters without '/'"
        )


def role_prefix(cluster: str, role: str | None) -> str:
    """The key prefix of one role's members (every member's if ``role`` is None)."""
    check_name("cluster", cluster)
    if role is None:
        return f"{K_PREFIX}{cluster}/"
    if role not in ROLES:
        raise LocalProtocolError(f"role {role!r} is not one of {ROLES}")
    return f"{K_PREFIX}{cluster}/{role}/"


def member_key(cluster: str, role: str, name: str) -> str:
    """``/pddnet/<cluster>/<role>/<name>``."""
    check_name("member name", name)
    return role_prefix(cluster, role) + name


def split_key(cluster: str, key: str) -> tuple[str, str]:
    """(role, name) of a member key under ``cluster``.

    Raises:
        RemoteProtocolError: if the key is not a member key of that cluster.
    """
    prefix = role_prefix(cluster, None)
    parts = key[len(prefix) :].split("/") if key.startswith(prefix) else []
    if len(parts) != 2 or parts[0] not in ROLES or not parts[1] or len(parts[1]) > K_MAX_NAME:
        raise RemoteProtocolError(f"{key[:200]!r} is not a member key of cluster {cluster!r}")
    return parts[0], parts[1]


def encode_member(info: EndpointInfo, load: Load) -> bytes:
    """The stored value of a member.

    Raises:
        LocalProtocolError: if ``info`` has a name that cannot be a key, a
            or a blob that readers would refuse (too large, a string too long).
    """
    check_name("member name", info.name)
    blob = info.blob()
    try:
        EndpointInfo.from_blob(blob)  # what every reader will check
    except RemoteProtocolError as exc:
        raise LocalProtocolError(
            f"readers would refuse {info.name}'s handshake blob: {exc.message}"
        ) from exc
    loads = {f.name: getattr(load, f.name) for f in fields(load)}
    # a parsable blob is at most K_MAX_BLOB, and the load map is a few ints:
    # the value is within K_MAX_VALUE
    return bytes(msgpack.packb([K_DIR_VERSION, blob, loads]))


def decode_member(key: str, cluster: str, value: bytes, revision: int) -> Member:
    """Parse a member's stored value, found under ``key``.

    Raises:
        RemoteProtocolError: if the key is not a member key, the value is
            oversized, malformed or of another version, or its blob names
            another role or member than the key.
    """
    role, name = split_key(cluster, key)
    if len(value) > K_MAX_VALUE:
        raise RemoteProtocolError(
            f"directory value of {len(value)} bytes at {key} (at most {K_MAX_VALUE})", peer=name
        )
    try:
        obj: Any = msgpack.unpackb(
            value,
            strict_map_key=True,
            max_array_len=3,
            max_map_len=K_MAX_LOAD_FIELDS,
            max_str_len=64,
            max_bin_len=K_MAX_BLOB,
        )
        version, blob, loads = obj
    except Exception as exc:
        raise RemoteProtocolError(f"malformed directory value at {key}: {exc}", peer=name) from exc
    if version != K_DIR_VERSION:
        raise RemoteProtocolError(
            f"directory value version {version!r} at {key} is not supported", peer=name
        )
    if not isinstance(blob, bytes) or not isinstance(loads, dict):
        raise RemoteProtocolError(f"directory value at {key} has bad field types", peer=name)
    info = EndpointInfo.from_blob(blob)
    if (info.role, info.name) != (role, name):
        raise RemoteProtocolError(
            f"directory value at {key} holds {info.role}/{info.name}", peer=name
        )
    known = {f.name for f in fields(Load)}
    try:
        load = Load(**{k: v for k, v in loads.items() if k in known})
    except LocalProtocolError as exc:
        raise RemoteProtocolError(f"bad load at {key}: {exc.message}", peer=name) from exc
    return Member(info, load, revision)
