"""How far the embedder's vectors move in bf16 and fp16 from the fp32 ones (issue 43, point 11).

carpool's own embedder (``deployments.embedder.TextEmbedder``, the packaged all-MiniLM-L6-v2,
mean pooling, L2-normalised) encodes the same texts at each dtype on CPU; the table gives
each dtype's cosine similarity to the fp32 vector of the same text (mean, 1st percentile,
minimum) and how many of each query's 10 nearest passages under fp32 it still finds
(recall@10). The texts: the paragraphs of carpool's packaged corpus (carpool/corpus/*.md) and
docs (docs/*.md) as passages, and the router's benchmark questions as queries.

    .venv/bin/python -m benchmarks.embed_dtype          # about a minute on 2 cores

CPU only here (no GPU was available): CPU half-precision kernels (oneDNN) round and
accumulate differently from a GPU's tensor cores, so these figures estimate the GPU's drift;
``make gpu-check`` is where a GPU measures it. Writes benchmarks/results/embed-dtype.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "embed-dtype.json"
DTYPES = ("float32", "bfloat16", "float16")


def passages(limit: int) -> list[str]:
    """Paragraphs of carpool's packaged corpus and its docs, the first ``limit``."""
    found = []
    paths = sorted((ROOT / "carpool" / "corpus").glob("*.md")) + sorted(ROOT.glob("docs/*.md"))
    for path in paths:
        for block in path.read_text().split("\n\n"):
            text = " ".join(block.split())
            if len(text) > 40:
                found.append(text)
    return found[:limit]


def queries(limit: int) -> list[str]:
    lines = (ROOT / "benchmarks" / "data" / "router_questions.jsonl").read_text().splitlines()
    return [json.loads(line)["question"] for line in lines[:limit]]


def embed(texts: list[str], dtype: str, batch: int = 32) -> tuple[np.ndarray, float]:
    """Vectors of ``texts`` from carpool's embedder at ``dtype`` on CPU, and seconds taken."""
    from deployments.embedder import EmbedderConfig, TextEmbedder

    config = EmbedderConfig.model_validate(
        {"source": {"model": "packaged:all-MiniLM-L6-v2", "device": "cpu", "dtype": dtype}}
    )
    model = TextEmbedder(config)
    started = time.perf_counter()
    out: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        out += model.embed_ids([model.truncate(t) for t in texts[i : i + batch]])
    return np.stack(out), time.perf_counter() - started


def recall_at_k(reference: np.ndarray, other: np.ndarray, k: int) -> float:
    """Mean share of each row's top-k columns under ``reference`` that ``other`` also ranks
    in its top k (rows: queries, columns: passages, values: similarities)."""
    ref = np.argsort(-reference, axis=1)[:, :k]
    got = np.argsort(-other, axis=1)[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ref, got, strict=True)]))


def measure(n_passages: int, n_queries: int, k: int = 10) -> dict[str, Any]:
    docs, asks = passages(n_passages), queries(n_queries)
    vectors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    seconds: dict[str, float] = {}
    for dtype in DTYPES:
        d, t_docs = embed(docs, dtype)
        q, t_asks = embed(asks, dtype)
        vectors[dtype], seconds[dtype] = (d, q), t_docs + t_asks
    ref_docs, ref_asks = vectors["float32"]
    ref_scores = ref_asks @ ref_docs.T
    rows = []
    for dtype in DTYPES:
        d, q = vectors[dtype]
        cos = np.concatenate([np.sum(d * ref_docs, axis=1), np.sum(q * ref_asks, axis=1)])
        rows.append(
            {
                "dtype": dtype,
                "cosine_mean": float(cos.mean()),
                "cosine_p1": float(np.percentile(cos, 1)),
                "cosine_min": float(cos.min()),
                f"recall_at_{k}": recall_at_k(ref_scores, q @ d.T, k),
                "seconds": round(seconds[dtype], 2),
            }
        )
    return {
        "model": "packaged:all-MiniLM-L6-v2",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "passages": len(docs),
        "queries": len(asks),
        "k": k,
        "rows": rows,
        "command": "python -m benchmarks.embed_dtype",
    }


def table(result: dict[str, Any]) -> str:
    k = result["k"]
    lines = [
        f"| dtype | cosine to fp32: mean | p1 | min | recall@{k} of fp32's neighbours | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['cosine_mean']:.6f} | {r['cosine_p1']:.6f} | "
            f"{r['cosine_min']:.6f} | {r[f'recall_at_{k}']:.3f} | {r['seconds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=400)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = measure(args.passages, args.queries)
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
