"""``python -m benchmarks.prefix_reuse``: time to first token of a prompt whose long prefix
is new against one whose prefix an earlier request sent, on one of serve.yaml's generators
run in this process by carpool's own engine (the code a replica runs, minus HTTP).

Each round sends a new ``--prefix-tokens`` prefix (deterministic words, different each round)
with a question, waits for it, then the same prefix with another question; ``max_tokens`` 1,
so the time is the prefill. Rounds alternate, one request at a time. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from carpool.generation.config import GeneratorConfig
from carpool.generation.factory import load_engine
from carpool.generation.sampling import SamplingParams
from carpool.generation.sequence import GenSequence, SeqEvent

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "river",
    "carpool",
    "mountain",
    "battery",
    "guitar",
    "market",
    "weather",
    "city",
    "story",
    "energy",
    "music",
    "cook",
]


def prefix_text(round_: int, tokens: int) -> str:
    """About ``tokens`` tokens of deterministic text, different for each round."""
    rng = random.Random(round_)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def time_to_first_token(engine: Any, prompt_ids: list[int]) -> float:
    first = threading.Event()
    started = time.perf_counter()
    seen: list[float] = []

    def sink(event: SeqEvent) -> None:
        if not seen and (event.token_ids or event.finish_reason):
            seen.append(time.perf_counter() - started)
            first.set()

    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.submit([GenSequence(prompt_ids, params, sink, index=0)])
    if not first.wait(600):
        raise TimeoutError("no first token within 600 s")
    return seen[0]


def generator_section(config: Path, tier: str) -> dict[str, Any]:
    for app in yaml.safe_load(config.read_text())["applications"]:
        if tier in app.get("args", {}) and isinstance(app["args"][tier], dict):
            return app["args"][tier]
    raise SystemExit(f"{config} has no generator section named {tier!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix_reuse", description=__doc__)
    parser.add_argument("--config", type=Path, default=ROOT / "serve.yaml")
    parser.add_argument("--tier", default="large", help="the generator section (mode continuous)")
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix-reuse-large.json"
    )
    args = parser.parse_args(argv)
    cfg = GeneratorConfig.model_validate(generator_section(args.config, args.tier))
    if cfg.mode != "continuous":
        raise SystemExit(f"{args.tier} runs mode {cfg.mode}: this measures carpool's own engine")
    loaded = load_engine(cfg)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    rows = []
    try:
        for r in range(args.rounds):
            prefix = tokenizer(prefix_text(r, args.prefix_tokens))["input_ids"]
            prefix = prefix[: args.prefix_tokens]
            ask = [tokenizer(f" Question {q}: which word comes first?")["input_ids"] for q in "AB"]
            new_s = time_to_first_token(engine, prefix + ask[0])
            repeat_s = time_to_first_token(engine, prefix + ask[1])
            rows.append(
                {"prompt_tokens": len(prefix) + len(ask[1]), "new_s": new_s, "repeat_s": repeat_s}
            )
            print(f"round {r}: new {new_s:.3f} s, repeated prefix {repeat_s:.3f} s", flush=True)
        stats = engine.stats()
    finally:
        engine.close()
    ratios = [row["new_s"] / row["repeat_s"] for row in rows]
    result = {
        "command": "python -m benchmarks.prefix_reuse "
        f"--tier {args.tier} --prefix-tokens {args.prefix_tokens} --rounds {args.rounds}",
        "model": cfg.source.model,
        "prefix_cache_mb": cfg.limits.prefix_cache_mb,
        "host": platform.node(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rounds": rows,
        "new_ttft_s_median": statistics.median(r["new_s"] for r in rows),
        "repeat_ttft_s_median": statistics.median(r["repeat_s"] for r in rows),
        "speedup_median": statistics.median(ratios),
        "speedup_min": min(ratios),
        "engine_stats": {k: v for k, v in stats.items() if k.startswith("prefix_cache")},
    }
    print(f"\n| {args.tier} | new prefix | repeated prefix | speed-up |")
    print("|---|---|---|---|")
    print(
        f"| TTFT median ({len(rows)} rounds, {rows[0]['prompt_tokens']} tokens) "
        f"| {result['new_ttft_s_median']:.3f} s | {result['repeat_ttft_s_median']:.3f} s "
        f"| {result['speedup_median']:.1f}x (min {result['speedup_min']:.1f}x) |"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
