"""Dashboards as data: panels and PromQL targets in Python, rendered to Grafana JSON.

The declarations are the source of truth; ``python -m dashboards render`` writes the JSON
that is committed (and provisioned), and a test fails when the two drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Ray exports custom metrics with a `ray_` prefix; these labels select one pipeline's series.
APP = 'application=~"$application"'
DEP = 'deployment=~"$deployment"'


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    targets: list[Target]
    unit: str = "short"
    kind: Literal["timeseries", "stat", "bargauge"] = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: list[Panel]
    tags: list[str] = field(default_factory=lambda: ["carpool"])


def _templating() -> dict[str, Any]:
    def query_var(name: str, label: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "query": {
                "query": f"label_values(ray_serve_deployment_replica_healthy, {name})",
                "refId": name,
            },
            "definition": f"label_values(ray_serve_deployment_replica_healthy, {name})",
            "includeAll": True,
            "multi": True,
            "current": {"selected": True, "text": "All", "value": "$__all"},
            "allValue": ".*",
            "refresh": 2,
        }

    return {
        "list": [
            {
                "name": "datasource",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
            },
            query_var("application", "Pipeline"),
            query_var("deployment", "Deployment"),
        ]
    }


def render(dashboard: Dashboard) -> dict[str, Any]:
    """Grafana dashboard JSON (schema 39), panels laid out left to right, top to bottom."""
    panels = []
    x = y = 0
    row_height = 0
    for number, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > 24:
            x, y = 0, y + row_height
            row_height = 0
        panels.append(
            {
                "id": number,
                "type": panel.kind,
                "title": panel.title,
                "description": panel.description,
                "datasource": DATASOURCE,
                "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "datasource": DATASOURCE,
                        "expr": target.expr,
                        "legendFormat": target.legend,
                    }
                    for i, target in enumerate(panel.targets)
                ],
            }
        )
        x += panel.width
        row_height = max(row_height, panel.height)
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": dashboard.tags,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": _templating(),
        "panels": panels,
    }


_NAME = re.compile(r"\b(ray_[a-zA-Z0-9_]+)\b")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (carpool and Ray series all start ``ray_``)."""
    return set(_NAME.findall(expr))
