"""P's vLLM connector config (``kv_connector_extra_config``), checked without vLLM."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pddnet import LocalProtocolError
from pddnet.integrations.vllm import PrefillConnectorConfig
from pddnet.kv import KVLayout, KVPool
from pddnet.route import LinkEstimate, RoutePolicy

K_FULL: dict[str, Any] = {
    "name": "p",
    "secret": "s" * 32,
    "model_id": "tiny@1",
    "sink": "user",
    "control_bind": "tcp://127.0.0.1:0",
    "lease_s": 5,
    "timeout": 30.0,
    "deadline_s": 12.5,
    "router": {"ttft_target_s": 1.0, "rld_decode_rate": 40, "skip_wan_short_output": True},
    "link": {"bandwidth_bytes_s": 1.25e8, "rtt_s": 0.05},
    "wan_options": {"streams": 4, "pacer_options": {"gain": 1.5}},
}


def test_full_config_reaches_the_endpoint() -> None:
    cfg = PrefillConnectorConfig.from_extra(json.loads(json.dumps(K_FULL)))  # as vLLM has it
    assert cfg.deadline_s == 12.5 and cfg.lease_s == 5.0 and cfg.sink == "user"
    assert cfg.policy == RoutePolicy(
        ttft_target_s=1.0, rld_decode_rate=40, skip_wan_short_output=True
    )
    pool = KVPool.allocate(KVLayout(2, 2, 8, 4, "float32"), 4)
    p = cfg.open_endpoint(pool)
    assert p.name == "p" and p.model_id == "tiny@1" and p.timeout == 30.0
    assert p.router.policy == cfg.policy
    assert p.router.link == LinkEstimate(1.25e8, 0.05)
    assert p.leases.duration_s == 5.0
    assert p._wan_options == {"streams": 4, "pacer_options": {"gain": 1.5}}


def test_minimal_config_keeps_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDDNET_SECRET", "e" * 32)
    cfg = PrefillConnectorConfig.from_extra({"name": "p"})
    assert cfg == PrefillConnectorConfig("p")
    p = cfg.open_endpoint(KVPool.allocate(KVLayout(2, 2, 8, 4, "float32"), 4))
    assert p.router.policy == RoutePolicy() and p._wan_options == {}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"name": None}, "['name']"),
        ({"nmae": "p"}, "['nmae']: unknown key"),
        ({"demo": {}}, "['demo']: unknown key"),
        ({"secret": b"raw"}, "['secret'] must be a string"),
        ({"deadline_s": 0}, "['deadline_s'] must be a finite number > 0"),
        ({"lease_s": True}, "['lease_s'] must be"),
        ({"timeout": float("inf")}, "['timeout'] must be"),
        ({"router": [1.0]}, "['router'] must be a dict"),
        ({"router": {"ttft": 1.0}}, "['router']['ttft']: not a RoutePolicy field"),
        ({"router": {"max_concurrent_relays": 1.5}}, "['max_concurrent_relays'] must be a int"),
        ({"router": {"skip_wan_short_output": 1}}, "['skip_wan_short_output'] must be a bool"),
        ({"router": {"rld_decode_rate": -1.0}}, "['router']: rld_decode_rate"),
        ({"link": {"rtt_s": 0.05}}, "['link'] needs exactly"),
        ({"link": {"bandwidth_bytes_s": 0, "rtt_s": 0.0}}, "['bandwidth_bytes_s'] must be"),
        ({"link": {"bandwidth_bytes_s": 1e8, "rtt_s": -1}}, "['rtt_s'] must be"),
        ({"wan_options": {"tls": None}}, "['wan_options']['tls']: not a WanSender option"),
        ({"wan_options": {"secret": "x"}}, "['wan_options']['secret']: not a WanSender"),
        ({"wan_options": {"pacer": object()}}, "['wan_options']['pacer'] must be JSON-able"),
        ({"layerwise": "yes"}, "['layerwise'] must be true or false"),
    ],
)
def test_bad_key_raises_naming_it(change: dict[str, Any], named: str) -> None:
    extra = {**K_FULL, **change}
    extra = {k: v for k, v in extra.items() if v is not None}
    with pytest.raises(LocalProtocolError, match="kv_connector_extra_config") as info:
        PrefillConnectorConfig.from_extra(extra)
    assert named in str(info.value)
