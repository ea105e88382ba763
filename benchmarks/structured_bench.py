"""What structured output costs: grammar compile time and decode time per token.

``python -m benchmarks.structured_bench [--model packaged:SmolLM2-135M-Instruct]``

Runs carpool's continuous engine in-process on the model, greedy, first without and then
with a JSON-schema constraint on every sequence (same prompts, same number of tokens), and
prints the compile times and the decode milliseconds per token of both runs. The schema has
one free-text field, so the constrained run generates as many tokens as asked rather than
ending early.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "year", "tags"],
}
PROMPTS = [
    "Describe a film as JSON.",
    "Give me a book as JSON.",
    "A song, in JSON:",
    "JSON for a painting:",
]


def _run(engine: Any, seqs: list[Any]) -> float:
    """Submits and waits; returns the summed decode seconds of the steps."""
    import threading

    done = threading.Event()
    left = [len(seqs)]
    lock = threading.Lock()

    def sink(event: Any) -> None:
        if event.finish_reason is not None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    for s in seqs:
        s.sink = sink
    before = engine.totals["decode_s"]
    engine.submit(seqs)
    if not done.wait(600):
        raise RuntimeError("the engine did not finish in 600 s")
    return engine.totals["decode_s"] - before


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="packaged:SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from carpool.generation.factory import make_engine
    from carpool.generation.sampling import SamplingParams
    from carpool.generation.scheduler import SchedulerLimits
    from carpool.generation.sequence import GenSequence, TokenizerInfo
    from carpool.generation.structured import ConstraintCompiler, OutputConstraint
    from carpool.models import resolve_model_source

    torch.set_num_threads(args.threads)
    path = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = TokenizerInfo.from_tokenizer(tokenizer, model.generation_config)
    vocab = model.get_output_embeddings().weight.shape[0]
    compiler = ConstraintCompiler(tokenizer, vocab, tok.eos_ids)
    start = time.perf_counter()
    compiler.compile(OutputConstraint.json_object())
    first_ms = (time.perf_counter() - start) * 1000  # tokenizer info + the first grammar
    start = time.perf_counter()
    compiled = compiler.compile(OutputConstraint.json_schema(SCHEMA))
    schema_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    compiler.compile(OutputConstraint.json_schema(SCHEMA))
    cached_ms = (time.perf_counter() - start) * 1000

    def seqs(constrained: bool) -> list[GenSequence]:
        out = []
        for i, prompt in enumerate(PROMPTS):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            grammar = compiler.state(compiled) if constrained else None
            out.append(GenSequence(list(ids), params, lambda e: None, index=i, grammar=grammar))
        return out

    engine = make_engine(
        "continuous", model, tok, SchedulerLimits(len(PROMPTS), 2048), 2048, block_size=64
    )
    try:
        _run(engine, seqs(False))  # warm-up
        free_s = _run(engine, seqs(False))
        constrained = seqs(True)
        json_s = _run(engine, constrained)
        json_tokens = sum(len(s.output_ids) for s in constrained)
    finally:
        engine.close()
        compiler.close()
    report = {
        "model": args.model,
        "vocab": vocab,
        "sequences": len(PROMPTS),
        "first_compile_ms": round(first_ms, 1),
        "schema_compile_ms": round(schema_ms, 1),
        "cached_compile_ms": round(cached_ms, 3),
        "free_decode_ms_per_step": round(free_s * 1000 / args.tokens, 2),
        "json_decode_ms_per_step": round(json_s * 1000 / max(json_tokens / len(PROMPTS), 1), 2),
        "json_tokens": json_tokens,
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
