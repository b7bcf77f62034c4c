"""kvtier's vLLM integration: ``kv_connector_module_path: kvtier.vllm``."""

from kvtier.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
