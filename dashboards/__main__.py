"""``python -m dashboards {render,check,push,names}``.

- render: write ``dashboards/json/<uid>.json`` from the declarations.
- check: exit 1 if the committed JSON differs from the declarations.
- push: create or update every dashboard in a Grafana server by uid (idempotent), with one
  POST per dashboard to its HTTP API (``/api/dashboards/db``, plain urllib: no client library
  to keep alive); ``GRAFANA_URL`` and ``GRAFANA_TOKEN`` come from the environment. With
  ``CARPOOL_GRAFANA_CLIENT=grafana-api`` (and ``pip install 'carpool[grafana]'``) the
  ``grafana-api`` package sends it instead.
- names: print the metric names the panels read.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
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


def push_dashboard(url: str, token: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict:
    """POSTs one dashboard to Grafana's ``/api/dashboards/db``; returns Grafana's answer.

    Raises ``RuntimeError`` with what to change when Grafana refuses or cannot be reached.
    """
    request = urllib.request.Request(
        url.rstrip("/") + "/api/dashboards/db",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        if exc.code in (401, 403):
            raise RuntimeError(
                f"Grafana refused GRAFANA_TOKEN ({exc.code} {detail}): use a service account "
                "token with the Editor role"
            ) from None
        raise RuntimeError(f"Grafana answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(
            f"cannot reach Grafana at {url} ({exc}): check GRAFANA_URL (e.g. http://127.0.0.1:3000)"
        ) from None


def _push_with_grafana_api(url: str, token: str, body: dict[str, Any]) -> dict:
    from grafana_api.grafana_face import GrafanaFace

    parsed = urlparse(url)
    grafana = GrafanaFace(
        auth=token,
        host=parsed.hostname,
        port=parsed.port,
        protocol=parsed.scheme or "http",
        url_path_prefix=parsed.path.strip("/"),
    )
    return grafana.dashboard.update_dashboard(body)


def push() -> int:
    url, token = os.environ.get("GRAFANA_URL"), os.environ.get("GRAFANA_TOKEN")
    if not url or not token:
        print(
            "set GRAFANA_URL (e.g. http://127.0.0.1:3000) and GRAFANA_TOKEN (a service "
            "account token with Editor role)",
            file=sys.stderr,
        )
        return 2
    send = push_dashboard
    if os.environ.get("CARPOOL_GRAFANA_CLIENT") == "grafana-api":
        send = _push_with_grafana_api
    for dashboard in DASHBOARDS:
        body = render(dashboard)
        body.pop("version", None)  # let Grafana keep counting; uid identifies the dashboard
        payload = {"dashboard": body, "overwrite": True, "message": "carpool dashboards push"}
        try:
            result = send(url, token, payload)
        except RuntimeError as exc:
            print(f"{dashboard.uid}: {exc}", file=sys.stderr)
            return 1
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
