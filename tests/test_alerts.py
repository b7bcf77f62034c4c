"""The shipped Prometheus alert rules parse and name only series kvtier exports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvtier.metrics import SERIES

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus-alerts.yaml"


def test_every_alert_names_a_series_kvtier_exports() -> None:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert rules and all({"alert", "expr", "annotations"} <= set(r) for r in rules)
    for rule in rules:
        names = set(re.findall(r"\bkvtier_[a-z_]+", rule["expr"]))
        assert names, rule["alert"]
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in SERIES, f"{rule['alert']}: {name} is not a kvtier series"
