"""One batched forward pass of a causal LM over a contiguous run of slot rows.

Prefill chunks and decode steps are the same operation: row ``j`` feeds the tokens at
positions ``[start_j, start_j + len_j)`` and attends to everything its slot holds up to each
token. Chunks are left-padded to the longest, so every row's last real token sits in the
last column and ``logits_to_keep=1`` computes the vocabulary projection once per row.
Padded tokens write to the cache's sink column and attend to position 0 only (a fully
masked row would give NaN).

The pass hands the model ready position ids and a 4-D additive mask, so any transformers
causal LM whose attention calls ``past_key_values.update`` works: Llama, Qwen2, Mistral...

On CPU in float32 the runner runs a twin of the model whose ``nn.Linear`` layers use
weights pre-packed once for oneDNN (``pack_linears``). Measured on SmolLM2-135M with one
thread, a 16-row decode step's matrix products went from ~100 ms (MKL sgemm on the plain
weights, slow at a few rows) to ~57 ms; the step from ~134 to ~82 ms. Same arithmetic in
float32, a different summation order: logits differ in the last bits (~1e-4), as they do
between batch sizes, and greedy tokens stay those of ``generate``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

from carpool.generation.kv import SlotCacheView, SlotKVCache

logger = logging.getLogger(__name__)

# Row count oneDNN picks its packed weight layout for. Measured on SmolLM2's shapes: hints
# of 16 to 512 ran 1 to 256 rows equally fast; a hint of 1 was up to 1.6x slower at 16 rows.
PACK_BATCH_HINT = 64


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def can_pack(model: Any) -> bool:
    """Whether ``pack_linears`` applies: float32 weights on CPU with oneDNN in this torch."""
    import torch

    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: Any, batch_hint: int = PACK_BATCH_HINT) -> Any:
    """A twin of ``model`` whose ``nn.Linear`` layers multiply by oneDNN-packed weights.

    The twin shares every parameter and buffer with ``model`` (the original stays usable, by
    the static engine or a tied embedding); the packed copies of the linear weights are
    extra memory, about the size of those weights. Only plain float32 ``nn.Linear`` modules
    are replaced; anything else runs as before.
    """
    import torch

    class PackedLinear(torch.nn.Module):
        """``nn.Linear`` with its weight reordered once into oneDNN's blocked layout."""

        def __init__(self, linear: Any) -> None:
            super().__init__()
            self.in_features = linear.in_features
            self.out_features = linear.out_features
            self.weight = linear.weight  # shared, for whoever reads it (shapes, ties)
            self.bias = linear.bias
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                linear.weight.detach(), batch_hint
            )

        def forward(self, x: Any) -> Any:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    memo: dict[int, Any] = {id(p): p for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    twin = copy.deepcopy(model, memo)
    replaced = 0
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child))
                replaced += 1
    logger.info("packed %d linear layers for oneDNN (batch hint %d)", replaced, batch_hint)
    return twin


class SlotRunner:
    """Runs passes over a ``SlotKVCache``; the engine decides rows and chunks."""

    def __init__(
        self,
        model: Any,
        max_rows: int,
        max_len: int,
        block_size: int,
        pad_token_id: int,
        packed_weights: bool = True,
    ) -> None:
        import torch

        self._torch = torch
        self.model = model
        # packed_weights: run the oneDNN-packed twin where it applies (CPU, float32).
        self.packed = False
        if packed_weights and can_pack(model):
            try:
                self.model = pack_linears(model)
                self.packed = True
            except Exception:  # an op missing from this torch build: run the plain model
                logger.warning("could not pack linear weights; running unpacked", exc_info=True)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        layers, kv_heads, head_dim = kv_geometry(model.config)
        self.cache = SlotKVCache(
            layers, kv_heads, head_dim, max_rows, max_len, block_size, self.dtype, self.device
        )
        self.pad_token_id = pad_token_id

    def forward(self, row0: int, chunks: Sequence[Sequence[int]], starts: Sequence[int]) -> Any:
        """Feeds ``chunks[j]`` at positions ``starts[j]...`` of row ``row0 + j``.

        Returns float32 logits ``[len(chunks), vocab]`` of each row's last fed token.
        """
        torch = self._torch
        n = len(chunks)
        width = max(len(c) for c in chunks)
        view_len = max(s + len(c) for s, c in zip(starts, chunks, strict=True))
        self.cache.ensure(row0 + n, view_len)
        sink = self.cache.sink

        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        write_at = torch.full((n, width), sink, dtype=torch.long)
        for j, (chunk, start) in enumerate(zip(chunks, starts, strict=True)):
            pad = width - len(chunk)
            ids[j, pad:] = torch.tensor(chunk, dtype=torch.long)
            span = torch.arange(start, start + len(chunk), dtype=torch.long)
            positions[j, pad:] = span
            write_at[j, pad:] = span
        # Query at position p sees keys 0..p of its own row; padded queries (position 0) see
        # key 0 only, which the row always holds by the time attention runs.
        keys = torch.arange(view_len, dtype=torch.long)
        allowed = keys.view(1, 1, 1, view_len) <= positions.view(n, 1, width, 1)
        mask = torch.zeros((n, 1, width, view_len), dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

        rows = torch.arange(row0, row0 + n, dtype=torch.long).view(n, 1).expand(n, width)
        view = SlotCacheView(
            self.cache, row0, rows.to(self.device), write_at.to(self.device), view_len
        )
        with torch.no_grad():
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=mask.to(self.device),
                past_key_values=view,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1, :].float()
