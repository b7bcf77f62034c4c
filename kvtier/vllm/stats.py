"""kvtier's counts on vLLM's connector stats path, and the Prometheus series they feed.

The path, all of it vLLM's (0.32):

1. Each engine step the worker's connector (``get_kv_connector_stats`` in the model runner)
   and then the scheduler's (in ``Scheduler.update_from_output``) drain their process's
   ``kvtier.metrics`` export batch into a ``KVTierStats``; vLLM aggregates the workers'
   and the scheduler's, and puts ``to_dict()`` into ``SchedulerStats.kv_connector_stats``.
2. The engine core ships that dict to the API server, where vLLM's Prometheus logger hands
   it to ``KVTierPromMetrics.observe`` (built by ``KVTierConnector.build_prom_metrics``),
   and its logging logger to ``KVTierStats`` (``aggregate`` over the log interval, then
   ``reduce`` for the "KV Transfer metrics" line).

Invariants:

* ``KVTierStats.data`` is a ``kvtier.metrics.BatchData``: plain dicts of numbers and lists.
  ``build`` copies what it is given, so ``aggregate`` never mutates a dict vLLM holds.
* A Prometheus child (one label set) is created on its first observation, so a series
  appears only once the engine has reported it: no series sits at a zero nobody fed.
* The series are vLLM's labels (``model_name``, ``engine``) plus kvtier's own
  (``kvtier.metrics.SERIES``).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.metrics import SERIES, BatchData, Kind, Series, label_values, merge


@dataclass
class KVTierStats(KVConnectorStats):
    """The records of one or more engine steps (see the module invariants)."""

    @classmethod
    def build(cls, data: BatchData | None = None) -> KVTierStats:
        return cls(data=copy.deepcopy(data) if data else {})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, KVTierStats):
            raise TypeError(f"cannot aggregate KVTierStats with {type(other).__name__}")
        merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not self.data

    def reduce(self) -> dict[str, int | float]:
        """One number per series and label set, for vLLM's periodic log line.

        Counters and gauges as they are; a histogram as its count and mean.
        """
        out: dict[str, int | float] = {}
        for name, values in sorted(self.data.items()):
            series = SERIES[name]
            short = name.removeprefix("kvtier_").removesuffix("_total")
            for key, value in sorted(values.items()):
                label = f"[{key}]" if series.labels else ""
                if series.kind is Kind.HISTOGRAM:
                    out[f"{short}{label}_count"] = len(value)
                    out[f"{short}{label}_mean"] = sum(value) / len(value) if value else 0.0
                else:
                    out[f"{short}{label}"] = value
        return out


#: Collectors built in this process, so a second build replaces them in the default
#: registry instead of failing on a duplicate name (vLLM rebuilds its own the same way).
_registered: list[Any] = []


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus collector per ``kvtier.metrics.SERIES`` entry, fed from engine stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        self._collectors: dict[str, Any] = {
            name: self._make(series) for name, series in SERIES.items()
        }
        _registered.extend(self._collectors.values())
        self._children: dict[tuple[int, str, str], Any] = {}

    def _make(self, s: Series) -> Any:
        labels = [*self._labelnames, *s.labels]
        # vLLM types the three classes as one union; each is called with its own options.
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls
        if s.kind is Kind.COUNTER:
            return counter(name=s.name, documentation=s.doc, labelnames=labels)
        if s.kind is Kind.GAUGE:
            return gauge(name=s.name, documentation=s.doc, labelnames=labels,
                         multiprocess_mode="mostrecent")
        return histogram(name=s.name, documentation=s.doc, labelnames=labels,
                         buckets=list(s.buckets))

    def _child(self, engine_idx: int, series: Series, key: str) -> Any:
        child = self._children.get((engine_idx, series.name, key))
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *label_values(series, key)]
            child = self._collectors[series.name].labels(*values)
            self._children[(engine_idx, series.name, key)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, values in transfer_stats_data.items():
            series = SERIES.get(name)
            if series is None:
                raise ValueError(f"unknown kvtier series {name!r} in connector stats")
            for key, value in values.items():
                child = self._child(engine_idx, series, key)
                if series.kind is Kind.COUNTER:
                    child.inc(value)
                elif series.kind is Kind.GAUGE:
                    child.set(value)
                else:
                    for v in value:
                        child.observe(v)


def _unregister_previous() -> None:
    while _registered:
        collector = _registered.pop()
        with contextlib.suppress(KeyError):  # built with test classes on another registry
            REGISTRY.unregister(collector)
