"""Human-readable byte sizes: ``"32GiB"`` <-> ``34359738368``.

Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) suffixes are accepted; a bare
integer is bytes. Parsing is strict: anything else raises ``ValueError`` naming the input.
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Return ``value`` in bytes. Raises ``ValueError`` for negative or malformed sizes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '32GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"expected a size such as '512MiB', '32GiB' or a byte count, got {value!r}"
        )
    number = float(m.group(1))
    return int(number * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """Format a byte count with a binary suffix, e.g. ``1.5GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")
