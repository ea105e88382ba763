"""``python -m dashboards {render,check,push,names}``.

- render: write ``dashboards/json/<uid>.json`` from the declarations.
- check: exit 1 if the committed JSON differs from the declarations.
- push: create or update every dashboard in a Grafana server by uid (idempotent), over its
  HTTP API with grafana-api; ``GRAFANA_URL`` and ``GRAFANA_TOKEN`` come from the environment.
- names: print the metric names the panels read.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from dashboards.definitions import DASHBOARDS
from dashboards.spec import metric_names, render

JSON_DIR = Path(__file__).with_name("json")


def rendered() -> dict[str, str]:
    return {
        f"{d.uid}.json": json.dumps(render(d), indent=2, sort_keys=True) + "\n" for d in DASHBOARDS
    }


def render_all() -> int:
    JSON_DIR.mkdir(exist_ok=True)
    for name, text in rendered().items():
        (JSON_DIR / name).write_text(text)
        print(f"wrote {JSON_DIR / name}")
    return 0


def check() -> int:
    stale = [
        n
        for n, t in rendered().items()
        if not (JSON_DIR / n).exists() or (JSON_DIR / n).read_text() != t
    ]
    extra = sorted({p.name for p in JSON_DIR.glob("*.json")} - set(rendered()))
    if stale or extra:
        print(f"dashboards out of date: {stale + extra}; run `python -m dashboards render`")
        return 1
    print("dashboards JSON matches the declarations")
    return 0


def push() -> int:
    url, token = os.environ.get("GRAFANA_URL"), os.environ.get("GRAFANA_TOKEN")
    if not url or not token:
        print(
            "set GRAFANA_URL (e.g. http://127.0.0.1:3000) and GRAFANA_TOKEN (a service "
            "account token with Editor role)",
            file=sys.stderr,
        )
        return 2
    from grafana_api.grafana_face import GrafanaFace

    parsed = urlparse(url)
    grafana = GrafanaFace(
        auth=token,
        host=parsed.hostname,
        port=parsed.port,
        protocol=parsed.scheme or "http",
        url_path_prefix=parsed.path.strip("/"),
    )
    for dashboard in DASHBOARDS:
        body = render(dashboard)
        body.pop("version", None)  # let Grafana keep counting; uid identifies the dashboard
        result = grafana.dashboard.update_dashboard(
            {"dashboard": body, "overwrite": True, "message": "carpool dashboards push"}
        )
        print(f"{dashboard.uid}: {result.get('status')} {result.get('url', '')}")
    return 0


def names() -> int:
    for name in sorted(
        {n for d in DASHBOARDS for p in d.panels for t in p.targets for n in metric_names(t.expr)}
    ):
        print(name)
    return 0


def main(argv: list[str]) -> int:
    commands = {"render": render_all, "check": check, "push": push, "names": names}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: python -m dashboards {{{','.join(commands)}}}", file=sys.stderr)
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
