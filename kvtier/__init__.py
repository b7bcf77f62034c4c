"""kvtier: a tiered KV-cache store for LLM serving.

Evicted KV moves GPU -> pinned host pool -> file/NFS or S3, and is restored by a read
instead of a recompute. See ``docs/architecture.md`` for the design.
"""

__version__ = "0.1.0"

#: Bumped whenever the on-tier object format or key derivation changes. Part of every
#: namespace digest, so objects from another format version are never matched.
FORMAT_VERSION = 1
