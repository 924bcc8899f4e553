"""Adapters that embed pddnet in third-party inference engines.

* :mod:`pddnet.integrations.vllm`: vLLM 0.32 (a tiny offline checkpoint for
  tests today; the KV connector for the P, RLD and MD roles is being built).
"""

__all__: list[str] = []
