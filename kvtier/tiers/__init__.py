"""Storage tiers. Every tier speaks the ``Tier`` protocol in ``kvtier.tiers.base``."""
