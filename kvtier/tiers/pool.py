"""``HostPool``: the data half of the host tier. One large allocation cut into slots.

Invariants:

* The pool is allocated and touched once, at construction. If the memory is not there,
  construction fails with the numbers and the setting to change; it never fails later.
* Slot ``i`` is bytes ``[i * slot_bytes, (i + 1) * slot_bytes)``; views never overlap.
* The pool knows nothing about keys. ``SlotIndex`` decides who may use a slot.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.sizes import format_size
from kvtier.tiers.base import TierError

log = logging.getLogger("kvtier.host")

#: Why ``pinned: yes`` failed: raised at start rather than silently pageable.
PINNED_UNAVAILABLE = (
    "tiers[0].host.pinned: yes, but the host pool cannot be page-locked here (no CUDA "
    "device, or the native extension is missing); use pinned: auto (page-locked when "
    "possible) or no"
)

#: ``allocator(nbytes) -> (buffer, is_pinned)``. The buffer must be page-aligned.
Allocator = Callable[[int], tuple[Any, bool]]


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mmap_allocator(nbytes: int) -> tuple[Any, bool]:
    """Anonymous, page-aligned, pre-faulted memory. Not pinned."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, nbytes, flags=flags), False


def default_allocator() -> Allocator:
    """``kvtier.ops.alloc_pinned`` when the native extension is importable, else mmap."""
    try:
        from kvtier.ops import alloc_pinned
    except ImportError:
        return mmap_allocator

    def _alloc(nbytes: int) -> tuple[Any, bool]:
        tensor, pinned = alloc_pinned(nbytes)
        return tensor.numpy(), pinned

    return _alloc


class HostPool:
    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        allocator: Allocator | None = None,
        setting: str = "tiers[0].host.capacity",
        check_memory: bool = True,
    ) -> None:
        if slot_bytes <= 0:
            raise TierError(f"host pool: slot size must be > 0, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots == 0:
            raise TierError(
                f"{setting}: {format_size(capacity_bytes)} holds no chunk of "
                f"{format_size(slot_bytes)}; raise the capacity or lower chunk_tokens"
            )
        nbytes = num_slots * slot_bytes
        avail = mem_available() if check_memory else None
        if avail is not None and nbytes > avail:
            raise TierError(
                f"{setting}: cannot allocate a {format_size(nbytes)} host pool, only "
                f"{format_size(avail)} of memory is available; lower the capacity"
            )
        try:
            buf, self.pinned = (allocator or default_allocator())(nbytes)
        except (OSError, MemoryError, RuntimeError) as e:
            raise TierError(
                f"{setting}: allocating a {format_size(nbytes)} host pool failed ({e}); "
                "lower the capacity"
            ) from e
        self._buf = buf  # keeps the allocation alive
        self._arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        if not self.pinned and check_memory:
            self._arr[:: mmap.PAGESIZE] = 0  # pre-fault every page now, not on first use
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        log.info(
            "host pool: %d slots x %s = %s (%s)",
            num_slots, format_size(slot_bytes), format_size(nbytes),
            "pinned" if self.pinned else "pageable",
        )

    def view(self, slot: int, nbytes: int | None = None) -> np.ndarray:
        """The first ``nbytes`` (default: all) bytes of ``slot`` as a writable uint8 array."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside pool of {self.num_slots}")
        n = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= n <= self.slot_bytes:
            raise ValueError(f"{n} bytes do not fit a slot of {self.slot_bytes}")
        start = slot * self.slot_bytes
        return self._arr[start : start + n]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes
