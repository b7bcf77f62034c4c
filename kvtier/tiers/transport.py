"""The small protocol an object tier's core (``kvtier.tiers.objtier``) speaks to its store:
a directory (``kvtier.tiers.file``) or an S3 prefix (``kvtier.tiers.s3``).

A transport moves bytes and metadata of one object at a time and lists the store a page
at a time; it keeps no index and decides nothing about recency, capacity or leases.

Invariants every transport keeps:

* ``write(create=True)`` never replaces an object (it raises ``Exists``); a write is
  atomic: a reader sees the whole object or none.
* ``read`` fills ``head`` (the header span) and ``body`` from one version of the object and
  returns its length and that version; ``delete_if`` and ``delete`` delete an object only
  while it is still the version named (where the store lets that be checked; each
  transport states its window).
* ``page(cursor)`` lists one small bounded slice of the store: one leaf directory
  (``kv/xx/yy``), or one listing page. Pages cover the key space in ascending order; a
  page says which key range ``[lo, hi]`` it covers (every object there is listed; the
  ranges of consecutive pages are contiguous) and the cursor of the next page, ``None``
  after the last (a full pass).
* ``slices()`` splits a pass at cursors that ``page`` returns as a ``next``: listing
  each slice from its first cursor to the next slice's lists exactly the pass.
* ``check_listing`` costs one call whatever the store holds (it lists nothing but at
  most one entry): what a tier's constructor may afford at ten million objects.
* Faults of the store raise one of ``faults`` (the core counts them and turns them into
  misses); nothing else is raised for I/O.
* Any thread may call any method.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvtier.keys import ChunkKey

#: The version of one object: an inode (and mtime), or an ETag.
Version = object
KEY_SPACE_END = (1 << 128) - 1


class Missing(Exception):
    """The object does not exist (or is not a regular object: never read)."""


class Changed(Exception):
    """The object was replaced while it was being read."""


class Exists(Exception):
    """A CREATE found the object already there."""


class Outcome(enum.Enum):
    DELETED = "deleted"
    KEPT = "kept"  # changed since the decision (or the store refused): not deleted
    GONE = "gone"  # no object there any more


@dataclass(frozen=True)
class Stat:
    """What a HEAD or ``stat`` says of one object."""

    size: int
    used: float  # the shared recency stamp: the file's mtime, S3's ``kvtier-used``
    version: Version


class Listed(NamedTuple):
    """One object of a listing page (a tuple: pages hold thousands)."""

    key: ChunkKey
    size: int
    used: float  # the shared stamp (file), or only the store's LastModified (S3)


@dataclass(frozen=True)
class Page:
    objects: list[Listed]
    lo: int  # the key range the page covers, as numbers (``compact.key_int``)
    hi: int
    next: object | None  # the cursor of the next page; None: this page ended a pass
    #: The page's extent (where ``lo``/``hi`` end) was read from the store now. False: it
    #: comes from a listing an earlier page read and carried in the cursor (a file tier's
    #: leaf directories of one top-level directory), so objects recorded since that earlier
    #: listing may lie in the range without being listed (``kvtier.tiers.walk``).
    fresh: bool = True


class Transport(Protocol):
    #: Exceptions that are store faults (counted, never raised out of the data path).
    faults: tuple[type[Exception], ...]
    #: A ``head`` costs little next to a write (a local ``stat``): CREATE asks first.
    cheap_head: bool
    #: Listing times are the shared stamp itself (else only an upper-bound hint).
    exact_listing: bool

    def describe(self, key: ChunkKey) -> str: ...

    def head(self, key: ChunkKey) -> Stat | None: ...

    def heads(self, keys: Sequence[ChunkKey]) -> list[Stat | None]:
        """``head`` of each (in parallel where the store gains from it)."""
        ...

    def read(self, key: ChunkKey, head: memoryview, body: memoryview,
             plan: int) -> tuple[int, Version]:
        """Raises ``Missing``, ``Changed`` or a fault."""
        ...

    def read_header(self, key: ChunkKey, head: memoryview) -> int | None:
        """Fill ``head`` with the object's first bytes; its length, None if absent."""
        ...

    def write(self, key: ChunkKey, header: memoryview, body: memoryview, *, create: bool,
              now: float) -> float:
        """Store the object stamped ``now``; returns the stamp it got. Raises ``Exists``."""
        ...

    def delete_if(self, key: ChunkKey, version: Version) -> Outcome | Exception:
        """Delete the object only while it is still ``version`` (a corrupt object); the
        outcome, or the store fault (returned, not raised)."""
        ...

    def stamp(self, key: ChunkKey, now: float) -> Stat | None:
        """Set the shared stamp to ``now`` unconditionally; the object's stat after it,
        None if it is not there."""
        ...

    def delete(self, victims: Sequence[tuple[ChunkKey, Stat | None]]
               ) -> tuple[dict[ChunkKey, Outcome], Exception | None]:
        """Delete each victim while it is still the version of its stat (None: any)."""
        ...

    def check_listing(self) -> None:
        """Raise a fault unless the store can be listed (one call, constant cost)."""
        ...

    def page(self, cursor: object | None) -> Page: ...

    def slices(self) -> list[object | None]:
        """A pass split into slices that can be listed apart (the start scan's threads):
        the first cursor of each, in key order, ``None`` first. Slice ``i`` ends at the
        page whose next cursor is slice ``i + 1``'s first (``None`` after the last)."""
        ...

    def close(self) -> None: ...
