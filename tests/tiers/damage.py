"""Hypothesis strategies that damage stored objects, shared by the format and tier
property tests: arbitrary msgpack values, mutated header fields, and damaged bytes."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvtier.objformat import HEADER_SPAN

FIELDS = ("ns", "key", "parent", "ntok", "dtype", "shape", "plen", "csum")

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # all msgpack can carry
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=24)
)

#: Any value msgpack can encode, nested a little.
any_value: st.SearchStrategy[Any] = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=8),
    max_leaves=10,
)

#: Values that are almost right for some field: sizes, counts and short byte strings.
_plausible: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=-1, max_value=2**64 - 1),
    st.sampled_from([0, 1, 63, 64, 65, 128, 4096]),
    st.binary(min_size=15, max_size=17),
    st.lists(st.integers(min_value=-1, max_value=2**64 - 1), max_size=3),
    st.sampled_from(["uint8", "float16", "", "made-up"]),
)

#: Values that once crashed a parser: conversions that overflow or allocate (``bytes(n)``,
#: ``int(inf)``), bools that pass for ints, strings that iterate like lists.
_hostile: st.SearchStrategy[Any] = st.sampled_from(
    [float("inf"), float("-inf"), float("nan"), -1, 2**48, 2**63, 2**64 - 1, True, "12", [-1]]
)


def mutated_wire(wire: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``wire`` with some fields replaced, removed or added."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out = dict(wire)
        changes = draw(
            st.dictionaries(st.sampled_from(FIELDS), _hostile | _plausible | any_value, max_size=3)
        )
        out.update(changes)
        for name in draw(st.sets(st.sampled_from(FIELDS), max_size=2)):
            out.pop(name, None)
        if draw(st.booleans()):
            out.update(draw(st.dictionaries(st.text(max_size=4), any_value, max_size=2)))
        return out

    return build()


def damaged_object(obj: bytes, wire: dict[str, Any], payload: bytes) -> st.SearchStrategy[bytes]:
    """``obj`` (a valid object of ``payload`` under header ``wire``) damaged one way:
    bytes flipped (mostly in the header), truncated, extended, its header rewritten, or
    replaced by arbitrary bytes behind a valid or random prefix."""
    from tests.tiers.harness import raw_object

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        kind = draw(st.sampled_from(["flip", "truncate", "extend", "wire", "garbage"]))
        if kind == "flip":
            out = bytearray(obj)
            where = st.integers(0, 160) | st.integers(0, len(obj) - 1)
            for pos, bits in draw(
                st.lists(st.tuples(where, st.integers(1, 255)), min_size=1, max_size=4)
            ):
                out[pos] ^= bits
            return bytes(out)
        if kind == "truncate":
            return obj[: draw(st.integers(0, len(obj) - 1))]
        if kind == "extend":
            return obj + draw(st.binary(min_size=1, max_size=64))
        if kind == "wire":
            cut = draw(st.integers(0, len(payload)))
            return raw_object(draw(mutated_wire(wire)), payload[:cut])
        junk = draw(st.binary(max_size=HEADER_SPAN + 128))
        return obj[:12] + junk if draw(st.booleans()) else junk

    return build()
