"""kvtier's vLLM integration: ``kv_connector_module_path: kvtier.vllm``.

``KVTierConnector`` is imported on first access (vLLM looks it up by name), so that
``kvtier.vllm.settings`` and friends can be used without importing vLLM itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module 'kvtier.vllm' has no attribute {name!r}")
