"""pddnet's vLLM 0.32 KV connectors, by the module path vLLM loads them from.

This module imports vLLM (``import pddnet.integrations.vllm`` does not). vLLM's
connector factory imports ``kv_connector_module_path`` and takes the class
named by ``kv_connector`` from it.

P (prefill; ``kv_connector_extra_config`` is
:class:`~pddnet.integrations.vllm.PrefillConnectorConfig`'s, only ``name``
required)::

    KVTransferConfig(
        kv_connector="PrefillKVConnector",
        kv_connector_module_path="pddnet.integrations.vllm.connectors",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "name": "p0",
            "model_id": "my-model@rev",
            "router": {"ttft_target_s": 1.0, "rld_decode_rate": 40.0},
            "link": {"bandwidth_bytes_s": 1.25e8, "rtt_s": 0.05},
            "wan_options": {"streams": 4},
            "deadline_s": 30.0,
        },
    )

RLD / MD (decode; :class:`~pddnet.integrations.vllm.VllmDecodeEngine` builds
this one itself)::

    KVTransferConfig(
        kv_connector="DecodeKVConnector",
        kv_connector_module_path="pddnet.integrations.vllm.connectors",
        kv_role="kv_consumer",
        kv_connector_extra_config={"staging_path": "/dev/shm/...", "staging_blocks": 1024},
    )
"""

from ._decode_connector import DecodeConnectorStatistics, DecodeKVConnector
from ._prefill_connector import PrefillConnectorStatistics, PrefillKVConnector

__all__ = [
    "DecodeConnectorStatistics",
    "DecodeKVConnector",
    "PrefillConnectorStatistics",
    "PrefillKVConnector",
]
