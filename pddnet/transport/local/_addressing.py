"""Addressing and network namespaces of the local path.

A receiver's address is ``ucx:NETNS:B64``: its network namespace (the inode
of ``/proc/self/ns/net``) and its UCX worker address; a grant's address adds
``#B64`` of its piece lengths. A sender in another namespace leaves UCX's
shared-memory transports out (:func:`tls_for_peer`: they connect but never
deliver across namespaces), and a receiver that must survive a dying sender
leaves out the transports that read the sender's memory
(:func:`tls_without_peer_reads`). See docs/local.md, *Environment settings*.
"""

from __future__ import annotations

import base64
import logging
import os

from ..._errors import LocalProtocolError
from ._worker import K_DEFAULT_TLS

__all__ = [
    "K_ADDR_PREFIX",
    "K_PEER_READ_TLS",
    "K_SHM_TLS",
    "b64",
    "netns_id",
    "parse_address",
    "tls_for_peer",
    "tls_without_peer_reads",
    "unb64",
]

log = logging.getLogger("pddnet.transport.local")

K_ADDR_PREFIX = "ucx:"
K_SHM_TLS = {"sm", "shm", "posix", "sysv", "mm"}  # break between network namespaces


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text.encode())


def netns_id() -> str:
    """This process's network namespace (its inode), or "" if unknown."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def parse_address(address: str) -> tuple[str, bytes]:
    """``ucx:[NETNS:]B64`` -> (the receiver's network namespace or "", its worker address)."""
    body = address[len(K_ADDR_PREFIX) :]
    netns, _, b64 = body.rpartition(":")
    try:
        return netns, unb64(b64)
    except ValueError as exc:
        raise LocalProtocolError(f"malformed UCX address: {exc}") from exc


def tls_for_peer(tls: str | None, peer_netns: str) -> str | None:
    """The transports to use towards a receiver in ``peer_netns``.

    UCX's shared-memory transports (``sm`` = ``posix``/``sysv``) connect but
    never deliver between network namespaces of one host (measured: every
    transfer timed out; ``tcp`` and ``cma`` work). So when the receiver is in
    another namespace they are replaced by ``cma`` (zero-copy rendezvous for
    large messages; small ones go over ``tcp``).
    """
    mine = netns_id()
    if not peer_netns or not mine or peer_netns == mine:
        return tls
    current = tls or os.environ.get("UCX_TLS") or K_DEFAULT_TLS
    names = [x for x in current.split(",") if x]
    kept = [x for x in names if x not in K_SHM_TLS]
    if kept == names:
        return tls
    if "cma" not in kept:
        kept.append("cma")
    log.info("UCX receiver in another network namespace: UCX_TLS %s -> %s", current, kept)
    return ",".join(kept)


K_PEER_READ_TLS = ("cma", "knem", "xpmem")  # transports that read the sender's memory


def tls_without_peer_reads(tls: str | None) -> str:
    """``tls`` (a ``UCX_TLS`` value; None: the environment's or the default)
    without the transports through which the receiver reads a sender's memory.

    Over ``cma`` UCX's rendezvous is the receiver's ``process_vm_readv`` of the
    sender's buffer; if the sender has died, that read fails and UCX, without
    endpoint error handling (which shared memory rules out), aborts the
    *receiving* process (measured: SIGABRT after ``cma_ep.c:85
    process_vm_readv(pid=...) returned -1: No such process``). ``sm`` is
    replaced by ``posix,sysv``, whose FIFOs carry the fragments instead.
    """
    current = tls or os.environ.get("UCX_TLS") or K_DEFAULT_TLS
    names = [x.strip() for x in current.split(",") if x.strip()]
    if not names or names[0].startswith("^") or names == ["all"]:
        ex = [n.lstrip("^") for n in names if n != "all"]
        return "^" + ",".join(dict.fromkeys([*ex, *K_PEER_READ_TLS]))
    out: list[str] = []
    for n in names:
        if n == "sm":
            out += ["posix", "sysv"]
        elif n not in K_PEER_READ_TLS:
            out.append(n)
    return ",".join(dict.fromkeys(out))
