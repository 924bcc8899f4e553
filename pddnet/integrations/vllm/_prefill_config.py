"""P's ``kv_connector_extra_config``, read and checked without vLLM.

:class:`PrefillKVConnector` reads its whole configuration from vLLM's
``KVTransferConfig.kv_connector_extra_config``, a JSON-able dict that travels
in vLLM's config. :meth:`PrefillConnectorConfig.from_extra` checks every key
when the connector is built, so a typo or a wrong type fails at engine start
with a :class:`~pddnet.LocalProtocolError` naming the key, not at the first
transfer.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._errors import LocalProtocolError
from ...api import PrefillEndpoint
from ...kv import KVPool
from ...route import LinkEstimate, RoutePolicy, Router
from ...transport.wan import WanSender

__all__ = ["PrefillConnectorConfig"]

# P passes the control plane's key itself; a TlsConfig is not JSON-able.
K_WAN_OPTIONS = frozenset(inspect.signature(WanSender).parameters) - {"address", "secret", "tls"}


def _key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _str(extra: Mapping[str, Any], name: str, default: str | None) -> str | None:
    value = extra.get(name, default)
    if value is not None and not isinstance(value, str):
        raise LocalProtocolError(f"{_key(name)} must be a string, not {value!r}")
    return value


def _positive(where: str, value: Any, *, zero: bool = False) -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not (value >= 0 if zero else value > 0):
        bound = ">= 0" if zero else "> 0"
        raise LocalProtocolError(f"{where} must be a finite number {bound}, not {value!r}")
    return float(value)


def _bool(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if not isinstance(value, bool):
        raise LocalProtocolError(f"{_key(name)} must be true or false, not {value!r}")
    return value


def _number(extra: Mapping[str, Any], name: str) -> float | None:
    return _positive(_key(name), extra[name]) if name in extra else None


def _like(where: str, value: Any, default: Any) -> Any:
    """``value`` checked against the type of a dataclass field's ``default``."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise LocalProtocolError(f"{where} must be a {type(default).__name__}, not {value!r}")
    return value


def _section(extra: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = extra.get(name, {})
    if not isinstance(value, Mapping):
        raise LocalProtocolError(f"{_key(name)} must be a dict, not {value!r}")
    return dict(value)


def _policy(extra: Mapping[str, Any]) -> RoutePolicy:
    given = _section(extra, "router")
    defaults = {f.name: f.default for f in dataclasses.fields(RoutePolicy)}
    kwargs = {}
    for k, v in given.items():
        where = f"{_key('router')}[{k!r}]"
        if k not in defaults:
            raise LocalProtocolError(f"{where}: not a RoutePolicy field ({sorted(defaults)})")
        kwargs[k] = _like(where, v, defaults[k])
    try:
        return RoutePolicy(**kwargs)
    except ValueError as exc:
        raise LocalProtocolError(f"{_key('router')}: {exc}") from exc


def _link(extra: Mapping[str, Any]) -> LinkEstimate | None:
    if "link" not in extra:
        return None
    given = _section(extra, "link")
    names = [f.name for f in dataclasses.fields(LinkEstimate)]
    if sorted(given) != sorted(names):
        raise LocalProtocolError(f"{_key('link')} needs exactly {names}, got {sorted(given)}")
    where = _key("link")
    return LinkEstimate(
        _positive(f"{where}['bandwidth_bytes_s']", given["bandwidth_bytes_s"]),
        _positive(f"{where}['rtt_s']", given["rtt_s"], zero=True),
    )


def _wan_options(extra: Mapping[str, Any]) -> dict[str, Any]:
    given = _section(extra, "wan_options")
    for k, v in given.items():
        where = f"{_key('wan_options')}[{k!r}]"
        if k not in K_WAN_OPTIONS:
            raise LocalProtocolError(f"{where}: not a WanSender option ({sorted(K_WAN_OPTIONS)})")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise LocalProtocolError(f"{where} must be JSON-able, not {v!r}") from exc
    return given


@dataclass(frozen=True, slots=True)
class PrefillConnectorConfig:
    """P's connector configuration, from ``kv_connector_extra_config``.

    Keys (all but ``name`` optional):

    * ``name``: P's node name (and engine id);
    * ``secret``: the control-plane secret (else ``$PDDNET_SECRET``);
    * ``model_id``: the model's fingerprint (:class:`~pddnet.api.PrefillEndpoint`);
    * ``sink``: the default sink node, for requests that name none;
    * ``control_bind``, ``lease_s``, ``timeout``: as for :class:`~pddnet.api.PrefillEndpoint`;
    * ``deadline_s``: each request's deadline, passed to ``submit`` (a
      request's own ``kv_transfer_params["pddnet"]["deadline_s"]`` wins);
    * ``router``: :class:`~pddnet.route.RoutePolicy` fields, e.g.
      ``{"ttft_target_s": 1.0, "rld_decode_rate": 40.0}``;
    * ``link``: the router's WAN estimate, ``{"bandwidth_bytes_s": ..., "rtt_s": ...}``
      (:class:`~pddnet.route.LinkEstimate`; the router's default if absent);
    * ``wan_options``: :class:`~pddnet.transport.wan.WanSender` keyword
      arguments for each sender to MD, e.g. ``{"streams": 4}``; JSON values
      only (``secret`` comes from the control plane, ``tls`` can't travel);
    * ``layerwise`` (default ``true``): submit when vLLM schedules the
      prompt's last prefill chunk and send each layer as its ``save_kv_layer``
      fires, the first token following once sampled; ``false`` submits the
      whole request from ``request_finished``.

    Raises :class:`~pddnet.LocalProtocolError` naming the first bad key.
    """

    name: str
    secret: str | None = None
    model_id: str = ""
    sink: str = ""
    control_bind: str | None = None
    lease_s: float | None = None
    timeout: float | None = None
    deadline_s: float | None = None
    policy: RoutePolicy = field(default_factory=RoutePolicy)
    link: LinkEstimate | None = None
    wan_options: dict[str, Any] = field(default_factory=dict)
    layerwise: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> PrefillConnectorConfig:
        """Check and read ``kv_connector_extra_config``."""
        known = ({f.name for f in dataclasses.fields(cls)} - {"policy"}) | {"router"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise LocalProtocolError(f"{_key(unknown[0])}: unknown key ({sorted(known)})")
        name = _str(extra, "name", None)
        if not name:
            raise LocalProtocolError(f"PrefillKVConnector needs {_key('name')}")
        return cls(
            name=name,
            secret=_str(extra, "secret", None),
            model_id=_str(extra, "model_id", "") or "",
            sink=_str(extra, "sink", "") or "",
            control_bind=_str(extra, "control_bind", None),
            lease_s=_number(extra, "lease_s"),
            timeout=_number(extra, "timeout"),
            deadline_s=_number(extra, "deadline_s"),
            policy=_policy(extra),
            link=_link(extra),
            wan_options=_wan_options(extra),
            layerwise=_bool(extra, "layerwise", True),
        )

    def open_endpoint(self, pool: KVPool) -> PrefillEndpoint:
        """P's endpoint over ``pool`` (not yet entered), as configured."""
        options: dict[str, Any] = {
            k: v
            for k, v in (
                ("control_bind", self.control_bind),
                ("lease_s", self.lease_s),
                ("timeout", self.timeout),
            )
            if v is not None
        }
        return PrefillEndpoint(
            self.name,
            pool,
            secret=self.secret,
            model_id=self.model_id,
            router=Router(self.policy, self.link),
            wan_options=dict(self.wan_options),
            **options,
        )
