"""Text generation with iteration-level (continuous) batching.

The pieces, from the wire to the weights:

- ``schemas``: OpenAI-compatible completions/chat wire formats, kept apart from the logic.
- ``sampling``: per-request sampling parameters and the torch sampler (greedy, temperature,
  top-p, seeded generators).
- ``text``: incremental detokenisation and stop-sequence matching (pure Python).
- ``scheduler``: the policy that decides, each step, which sequences decode, which prompt
  chunks prefill and which waiting requests are admitted (pure Python, no torch, no Ray).
- ``kv``: the slot KV cache (one row per running sequence) the continuous runner writes into.
- ``runner``: one batched forward pass over a run of slot rows (prefill chunks or decode).
- ``engine``: the ``GenerationEngine`` interface and its two implementations, ``continuous``
  (own scheduler over the slot cache) and ``static`` (one padded ``generate`` per batch).
- ``metrics``: the Ray metrics a generator replica exports.

The measurements live outside the package, in ``benchmarks``: ``python -m
benchmarks.generation_compare`` (continuous vs static) and ``python -m
benchmarks.structured_bench`` (what structured output costs).
"""
