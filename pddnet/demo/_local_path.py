"""The demo's local path (P -> RLD): UCX, checked by one real transfer first, or TCP.

The demo's driver calls :func:`choose_local_path` once its hosts exist and
before the phases; the relay role obeys ``cfg["local_path"]``. Kept out of
``_roles`` so that the driver does not import the role module it also runs
as ``__main__``.
"""

from __future__ import annotations

from typing import Any

from ..transport.local import probe_local_path

__all__ = ["choose_local_path", "local_path_summary"]


def choose_local_path(
    cfg: dict[str, Any], spawn_relay: Any, spawn_prefill: Any, where: str
) -> dict[str, Any]:
    """Settle the relay's local path before the phases, and print why.

    With ``cfg["local_path"] == "ucx"`` (the demo's default) a short UCX
    transfer from P's host to RLD's (:func:`~pddnet.transport.local.probe_local_path`,
    each a process spawned by ``spawn_prefill`` / ``spawn_relay``) decides: if
    it fails, ``cfg["local_path"]`` becomes ``"tcp"`` and the printed line says
    the failure in UCX's or ucxx's own words.

    Returns:
        ``{"path", "transports", "tls", "reason"}`` for the summary
        (:func:`local_path_summary`).
    """
    if cfg["local_path"] != "ucx":
        print(f"P->RLD local path: TCP (--local-path {cfg['local_path']})", flush=True)
        return {"path": "tcp", "transports": [], "tls": "", "reason": "--local-path tcp"}
    probe = probe_local_path(spawn_relay, spawn_prefill)
    if probe.path == "ucx":
        print(
            f"P->RLD local path: UCX ({where}: {', '.join(probe.transports) or '?'};"
            f" UCX_TLS {probe.tls})",
            flush=True,
        )
    else:
        print(f"P->RLD local path: TCP, because UCX failed ({where}): {probe.reason}", flush=True)
    cfg["local_path"] = probe.path
    return {
        "path": probe.path,
        "transports": list(probe.transports),
        "tls": probe.tls,
        "reason": probe.reason,
    }


def local_path_summary(phases: dict[str, Any]) -> dict[str, Any]:
    """The summary's local-path keys: the path P connected to in the pdd phase
    (what its relay published), and the probe's transports or its failure."""
    choice = phases.get("local_path") or {}
    seen = phases.get("pdd", {}).get("stats", {}).get("local_path")
    return {
        "local_path": seen or choice.get("path"),
        "local_transports": choice.get("transports", []),
        "local_path_reason": choice.get("reason"),
    }
