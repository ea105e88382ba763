"""``python -m dashboards.snapshot``: PNG renders of every panel, from a real Prometheus.

Runs each panel's queries over the last minutes (``query_range``) and draws them with
matplotlib, one PNG per dashboard, so the README can show what the dashboards show without
a Grafana server.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import httpx

from dashboards.definitions import DASHBOARDS


def query_range(prometheus: str, expr: str, minutes: float, step_s: float) -> list[dict]:
    expr = expr.replace("$application", ".*").replace("$deployment", ".*")
    end = time.time()
    response = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": end - minutes * 60, "end": end, "step": step_s},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    return text or ",".join(f"{k}={v}" for k, v in labels.items())


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--step", type=float, default=5)
    parser.add_argument("--out", default="docs/monitoring")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for dashboard in DASHBOARDS:
        cols = 2
        rows = math.ceil(len(dashboard.panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(12, 3 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, dashboard.panels, strict=False):
            for target in panel.targets:
                for series in query_range(args.prometheus, target.expr, args.minutes, args.step):
                    points = [
                        (float(t), float(v)) for t, v in series["values"] if math.isfinite(float(v))
                    ]
                    if points:
                        start = points[0][0]
                        ax.plot(
                            [(t - start) / 60 for t, _ in points],
                            [v for _, v in points],
                            label=legend(target.legend, series["metric"])[:40],
                        )
            ax.set_title(panel.title, fontsize=9)
            ax.set_xlabel("minutes", fontsize=7)
            ax.set_ylabel(panel.unit, fontsize=7)
            ax.tick_params(labelsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(dashboard.panels) :]:
            ax.axis("off")
        fig.suptitle(dashboard.title)
        fig.tight_layout()
        path = out / f"{dashboard.uid}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
