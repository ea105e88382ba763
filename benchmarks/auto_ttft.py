"""``python -m benchmarks.auto_ttft``: does ``model: auto`` stream as early as the model it picks?

Issue 25 asks that a streamed ``auto`` request reach its first token within 1.5x of the
chosen model's own time to first token. This deploys serve.yaml's generate app (the router,
small and large generators, as shipped) on a private Ray, then measures in paired rounds:
closed loops of streamed ``/generate/v1/completions`` requests to ``auto``, ``small`` and
``large`` in turn (order rotated per round), the same generate-mixed requests for each.
Every ``auto`` answer names the model that answered (the ``x-carpool-model`` header), so its
TTFT is compared with direct requests to that model measured in the same round.

TTFT here is from sending the request to the first chunk with text, at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.peers import HOST, PORTS, carpool_cluster
from benchmarks.stats import percentile
from benchmarks.workloads import GenerateRequest, generate_workload

MODELS = ("auto", "small", "large")


async def one(
    client: httpx.AsyncClient, url: str, model: str, request: GenerateRequest
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", url, json=body) as response:
        chosen = response.headers.get("x-carpool-model", model)
        status = response.status_code
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
    done = time.perf_counter()
    return {
        "model": model,
        "chosen": chosen,
        "status": status,
        "ttft_s": None if first is None else first - sent,
        "latency_s": done - sent,
        "max_tokens": request.max_tokens,
    }


async def window(
    base: str, model: str, requests: list[GenerateRequest], clients: int
) -> list[dict[str, Any]]:
    """A closed loop: ``clients`` workers take the next request until none are left."""
    queue: asyncio.Queue[GenerateRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    records: list[dict[str, Any]] = []
    url = f"{base}/generate/v1/completions"

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            records.append(await one(client, url, model, queue.get_nowait()))

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return records


def ttft_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    values = sorted(r["ttft_s"] * 1000 for r in records if r["ttft_s"] is not None)
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": statistics.median(values),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=40, help="requests per model per round")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/auto-ttft.json")
    args = p.parse_args(argv)

    start, stop = carpool_cluster(["generate"])
    base = f"http://{HOST}:{PORTS['carpool']}"
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    facts = start()
    try:
        warm = list(generate_workload(6, seed=999).requests)
        for model in MODELS:
            asyncio.run(window(base, model, warm, 2))
        for r in range(args.rounds):
            requests = list(generate_workload(args.requests, seed=args.seed + r).requests)
            order = MODELS[r % 3 :] + MODELS[: r % 3]
            per_model: dict[str, list[dict[str, Any]]] = {}
            for model in order:
                per_model[model] = asyncio.run(window(base, model, requests, args.clients))
                s = ttft_stats(per_model[model])
                print(
                    f"round {r + 1} {model}: TTFT p50 {s.get('p50_ms', float('nan')):.0f} ms, "
                    f"p90 {s.get('p90_ms', float('nan')):.0f} ms (n={s['n']})",
                    file=sys.stderr,
                )
            rounds.append(per_model)
    finally:
        stop()

    summary: dict[str, Any] = {"rounds": []}
    for per_model in rounds:
        row: dict[str, Any] = {m: ttft_stats(recs) for m, recs in per_model.items()}
        for chosen in ("small", "large"):
            picked = [x for x in per_model["auto"] if x["chosen"] == chosen]
            row[f"auto->{chosen}"] = ttft_stats(picked)
            direct, via = row[chosen], row[f"auto->{chosen}"]
            if via["n"] and direct["n"]:
                row[f"auto->{chosen}/direct p50"] = via["p50_ms"] / direct["p50_ms"]
                row[f"auto->{chosen}/direct p90"] = via["p90_ms"] / direct["p90_ms"]
        row["auto/chosen-mix p50"] = _mix_ratio(per_model)
        summary["rounds"].append(row)
    ratios = [r["auto/chosen-mix p50"] for r in summary["rounds"] if r["auto/chosen-mix p50"]]
    summary["auto_over_chosen_p50_median"] = statistics.median(ratios) if ratios else None
    failures = sum(x["status"] != 200 for pm in rounds for recs in pm.values() for x in recs)

    print(
        "| round | auto p50 / p90 ms | small p50 / p90 | large p50 / p90 | auto picked small"
        " / large | auto vs its choice, p50 |"
    )
    print("|---|---|---|---|---|---|")
    for i, row in enumerate(summary["rounds"], 1):
        cells = [f"{row[m]['p50_ms']:.0f} / {row[m]['p90_ms']:.0f}" for m in MODELS]
        picks = f"{row['auto->small']['n']} / {row['auto->large']['n']}"
        print(f"| {i} | " + " | ".join(cells) + f" | {picks} | {row['auto/chosen-mix p50']:.2f} |")
    print(
        f"median auto TTFT p50 / chosen model's direct p50: "
        f"{summary['auto_over_chosen_p50_median']:.2f}x; non-200 answers: {failures}"
    )
    out = {
        "command": "python -m benchmarks.auto_ttft " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "cluster": facts,
        "summary": summary,
        "non_200": failures,
        "records": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _mix_ratio(per_model: dict[str, list[dict[str, Any]]]) -> float | None:
    """auto's TTFT p50 over what its picks would have cost directly (the direct p50 of each
    pick, weighted by how often auto picked it)."""
    auto = [x for x in per_model["auto"] if x["ttft_s"] is not None]
    if not auto:
        return None
    direct = {m: ttft_stats(per_model.get(m, [])) for m in {x["chosen"] for x in auto}}
    expected = [direct[x["chosen"]]["p50_ms"] for x in auto if direct[x["chosen"]]["n"]]
    if not expected:
        return None
    return ttft_stats(auto)["p50_ms"] / statistics.mean(expected)


if __name__ == "__main__":
    raise SystemExit(main())
