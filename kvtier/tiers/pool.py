"""``HostPool``: the data half of the host tier. One host buffer cut into equal slots.

Where the buffer comes from (the memory itself is ``kvtier.hostmem``'s business):

* ``HostPool.allocate(capacity, slot_bytes)``: private memory of this process (the
  ``allocator``: page-locked when CUDA is there, else anonymous ``mmap``).
* ``HostPool.create_shm(path, slot_bytes, num_slots, pinned=...)``: a pool in a new
  shared file that other processes will map; its creator makes the file (never one that
  exists, never through a symlink), sizes it, faults it in and page-locks it as
  ``pinned`` says (vLLM's worker).
* ``HostPool.attach_shm(path, slot_bytes, num_slots)``: the same pool, mapped by another
  process (vLLM's scheduler); the name is unlinked once mapped.
* ``HostPool(buf, slot_bytes, num_slots, pinned=...)``: over a buffer the caller holds.

Invariants:

* The memory is had, faulted in and (as asked) page-locked at construction. If it is not
  there, construction fails with the numbers and the setting to change (``TierError``);
  it never fails later.
* Slot ``i`` is bytes ``[i * slot_bytes, (i + 1) * slot_bytes)``; views never overlap.
* Two pools over one shared file with the same ``slot_bytes`` and ``num_slots`` agree on
  every slot's bytes; ``attach_shm`` refuses a file of another size.
* The pool knows nothing about keys. ``SlotIndex`` decides who may use a slot.

Thread safety: nothing changes after construction; any thread may call ``view``. Who may
touch a slot's bytes, and when, is decided by ``SlotIndex`` (and, across processes, by
the scheduler's copy orders to the worker).
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvtier.hostmem import (
    PINNED_UNAVAILABLE,
    Allocator,
    HostMemoryError,
    attach_shared,
    create_shared,
    mem_available,
    mmap_allocator,
    register_pinned,
    remove_shared,
)
from kvtier.sizes import format_size
from kvtier.tiers.base import TierError

__all__ = [  # the memory names are re-exported for callers of the old paths
    "CAPACITY",
    "PINNED_UNAVAILABLE",
    "Allocator",
    "HostPool",
    "PinMode",
    "default_allocator",
    "mem_available",
    "mmap_allocator",
]

log = logging.getLogger("kvtier.host")

#: ``tiers[0].host.pinned``: page-lock the pool always (else fail), when possible, never.
PinMode = Literal["auto", "yes", "no"]

CAPACITY = "tiers[0].host.capacity"


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
    def __init__(self, buf: Any, slot_bytes: int, num_slots: int, *, pinned: bool) -> None:
        """Slots over ``buf`` (page-aligned, at least ``num_slots * slot_bytes`` bytes),
        which the pool keeps alive. Neither allocates nor touches memory."""
        if slot_bytes <= 0 or num_slots <= 0:
            raise TierError(
                f"host pool: slot size and count must be > 0, got {slot_bytes} x {num_slots}"
            )
        nbytes = num_slots * slot_bytes
        self._buf = buf  # keeps the memory alive
        self._arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pinned

    # -- constructors ----------------------------------------------------------------------
    @staticmethod
    def slots_for(capacity_bytes: int, slot_bytes: int, *, setting: str = CAPACITY) -> int:
        """How many ``slot_bytes`` slots ``capacity_bytes`` hold; ``TierError`` if none."""
        if slot_bytes <= 0:
            raise TierError(f"host pool: slot size must be > 0, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots == 0:
            raise TierError(
                f"{setting}: {format_size(capacity_bytes)} holds no chunk of "
                f"{format_size(slot_bytes)}; raise the capacity or lower chunk_tokens"
            )
        return num_slots

    @classmethod
    def allocate(
        cls,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        allocator: Allocator | None = None,
        setting: str = CAPACITY,
        check_memory: bool = True,
    ) -> HostPool:
        """As many slots as ``capacity_bytes`` hold, in memory of this process."""
        num_slots = cls.slots_for(capacity_bytes, slot_bytes, setting=setting)
        nbytes = num_slots * slot_bytes
        avail = mem_available() if check_memory else None
        if avail is not None and nbytes > avail:
            raise TierError(
                f"{setting}: cannot allocate a {format_size(nbytes)} host pool, only "
                f"{format_size(avail)} of memory is available; lower the capacity"
            )
        try:
            buf, pinned = (allocator or default_allocator())(nbytes)
        except (OSError, MemoryError, RuntimeError, HostMemoryError) as e:
            raise TierError(
                f"{setting}: allocating a {format_size(nbytes)} host pool failed ({e}); "
                "lower the capacity"
            ) from e
        pool = cls(buf, slot_bytes, num_slots, pinned=pinned)
        if not pinned and check_memory:
            pool._arr[:: mmap.PAGESIZE] = 0  # pre-fault every page now, not on first use
        pool._log("private")
        return pool

    @classmethod
    def create_shm(
        cls,
        path: Path,
        slot_bytes: int,
        num_slots: int,
        *,
        pinned: PinMode = "auto",
        setting: str = CAPACITY,
    ) -> HostPool:
        """Create the shared pool file ``path`` and map it: sized, faulted in and, unless
        ``pinned`` is ``no``, page-locked for CUDA in this process. ``pinned: yes`` that
        cannot be honoured fails (``PINNED_UNAVAILABLE``). On failure the file is removed.
        The caller removes it (``kvtier.hostmem.remove_shared``) when done.

        ``path`` must not exist: a file or symlink of that name is a ``TierError`` naming
        it and what to do (``O_EXCL | O_NOFOLLOW``; it is neither truncated nor followed)."""
        nbytes = num_slots * slot_bytes
        try:
            mm = create_shared(path, nbytes, setting=setting)
        except HostMemoryError as e:
            raise TierError(str(e)) from e
        locked = False
        try:
            if pinned != "no":
                locked = register_pinned(mm, owner=mm)  # H2D/D2H DMA on CUDA
            if pinned == "yes" and not locked:
                raise TierError(PINNED_UNAVAILABLE)
        except RuntimeError as e:
            remove_shared(path)
            raise TierError(f"tiers[0].host.pinned: {e}; use pinned: no") from e
        except BaseException:
            remove_shared(path)
            raise
        pool = cls(mm, slot_bytes, num_slots, pinned=locked)
        pool._log(f"shared {path}")
        return pool

    @classmethod
    def attach_shm(
        cls, path: Path, slot_bytes: int, num_slots: int, *, unlink: bool = True,
        pinned: PinMode = "no",
    ) -> HostPool:
        """Map the shared pool another process created with ``create_shm`` and the same
        ``slot_bytes`` and ``num_slots``; with ``unlink`` (the last process to attach)
        its name is removed once mapped.

        ``FileNotFoundError`` if it does not exist (the caller knows who should have
        created it); ``TierError`` naming both sizes if it has another size. Page-locking
        is per process: ``pinned`` as for ``create_shm`` (another TP rank's worker copies
        to and from the GPU too; the scheduler process does not, and pins nothing)."""
        try:
            mm = attach_shared(path, num_slots * slot_bytes, unlink=unlink)
        except HostMemoryError as e:
            raise TierError(f"kvtier: {e}") from e
        locked = False
        if pinned != "no":
            try:
                locked = register_pinned(mm, owner=mm)
            except RuntimeError as e:
                raise TierError(f"tiers[0].host.pinned: {e}; use pinned: no") from e
            if pinned == "yes" and not locked:
                raise TierError(PINNED_UNAVAILABLE)
        return cls(mm, slot_bytes, num_slots, pinned=locked)

    def _log(self, kind: str) -> None:
        log.info(
            "host pool (%s): %d slots x %s = %s (%s)",
            kind, self.num_slots, format_size(self.slot_bytes), format_size(self.nbytes),
            "pinned" if self.pinned else "pageable",
        )

    # -- data ------------------------------------------------------------------------------
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
    def array(self) -> np.ndarray:
        """The whole pool as one writable uint8 array (``torch.from_numpy`` shares it)."""
        return self._arr

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes
