"""The slot KV cache: one row of preallocated key/value memory per running sequence.

Layout per layer: ``[rows, kv_heads, length + 1, head_dim]``. Row ``r`` holds the sequence
in slot ``r`` at its true positions, so RoPE positions and attention need no left padding
and a sequence's cached values never move while it runs. Running sequences occupy rows
``0..n-1`` (the engine compacts on leave by moving the last row into the hole), so a pass
reads a plain slice of the buffer; no per-step gather or concatenation.

The last column is a write sink: padded query positions write their keys and values there,
so a padded batch never touches a real position. It is never inside an attended view.

Memory is sized explicitly: rows grow in steps of ``ROW_STEP`` up to ``max_rows`` and length
in ``block_size`` blocks up to ``max_len``, so the cache never holds more than
``max_rows x (max_len + 1)`` tokens; ``release()`` returns it all when the engine idles.
"""

from __future__ import annotations

from typing import Any

# Rows are added four at a time: growing copies the whole cache, so not on every arrival.
ROW_STEP = 4


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


class SlotKVCache:
    """Keys and values of all layers for up to ``max_rows`` sequences of ``max_len`` tokens."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_len: int,
        block_size: int,
        dtype: Any,
        device: Any,
    ) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_rows = max_rows
        self.max_len = max_len
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.rows = 0  # allocated rows
        self.length = 0  # allocated positions per row (plus one sink column)
        self.keys: list[Any] = []
        self.values: list[Any] = []

    @property
    def bytes_per_token(self) -> int:
        import torch

        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize

    @property
    def max_bytes(self) -> int:
        return self.max_rows * (self.max_len + 1) * self.bytes_per_token

    @property
    def allocated_bytes(self) -> int:
        return self.rows * (self.length + 1) * self.bytes_per_token if self.keys else 0

    @property
    def blocks_allocated(self) -> int:
        return self.rows * (self.length // self.block_size) if self.keys else 0

    @property
    def blocks_total(self) -> int:
        return self.max_rows * -(-self.max_len // self.block_size)

    @property
    def sink(self) -> int:
        """Column index where padded positions write."""
        return self.length

    def ensure(self, rows: int, length: int) -> None:
        """Grows the buffers (copying what they hold) so ``rows`` x ``length`` fits."""
        import torch

        if rows > self.max_rows or length > self.max_len:
            raise ValueError(
                f"KV cache asked for {rows} rows x {length} positions; it holds at most "
                f"{self.max_rows} x {self.max_len}"
            )
        if self.keys and rows <= self.rows and length <= self.length:
            return
        new_rows = min(self.max_rows, max(self.rows, _round_up(rows, ROW_STEP)))
        new_len = min(self.max_len, max(self.length, _round_up(length, self.block_size)))
        shape = (new_rows, self.kv_heads, new_len + 1, self.head_dim)
        # Zeros, not empty: masked positions are multiplied by zero weights, and 0 x NaN
        # from uninitialised memory would poison the output.
        keys = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        values = [torch.zeros_like(k) for k in keys]
        for old, new in ((self.keys, keys), (self.values, values)):
            for layer, tensor in enumerate(old):
                new[layer][: self.rows, :, : self.length] = tensor[:, :, : self.length]
        self.keys, self.values = keys, values
        self.rows, self.length = new_rows, new_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copies the first ``length`` positions of row ``src`` into row ``dst``."""
        if src == dst or length <= 0:
            return
        for buffers in (self.keys, self.values):
            for tensor in buffers:
                tensor[dst, :, :length] = tensor[src, :, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchanges the first ``length`` positions of rows ``a`` and ``b``."""
        if a == b or length <= 0:
            return
        for buffers in (self.keys, self.values):
            for tensor in buffers:
                tmp = tensor[a, :, :length].clone()
                tensor[a, :, :length] = tensor[b, :, :length]
                tensor[b, :, :length] = tmp

    def read_prefix(self, row: int, length: int) -> tuple[list[Any], list[Any]]:
        """Copies of the first ``length`` positions of ``row``, per layer
        ``[kv_heads, length, head_dim]`` (for the prefix cache)."""
        keys = [t[row, :, :length].clone() for t in self.keys]
        values = [t[row, :, :length].clone() for t in self.values]
        return keys, values

    def write_prefix(self, row: int, keys: list[Any], values: list[Any], length: int) -> None:
        """Puts a cached prefix's first ``length`` positions into ``row``."""
        self.ensure(row + 1, length)
        for buffers, source in ((self.keys, keys), (self.values, values)):
            for tensor, cached in zip(buffers, source, strict=True):
                tensor[row, :, :length] = cached[:, :length]

    def release(self) -> None:
        """Frees all memory (the engine calls this when nothing is running)."""
        self.keys, self.values = [], []
        self.rows = self.length = 0


class SlotCacheView:
    """What a model's attention layers see as ``past_key_values`` during one pass.

    ``update`` scatters the pass's new keys/values into their slot rows at their positions
    and returns the attended slice ``rows [row0, row0+n) x positions [0, view_len)``. It
    duck-types transformers' ``Cache.update``; the pass supplies a ready 4-D mask, so the
    model never asks the cache for lengths.
    """

    def __init__(
        self, cache: SlotKVCache, row0: int, row_index: Any, pos_index: Any, view_len: int
    ) -> None:
        self.cache = cache
        self.row0 = row0
        self.rows = row_index.shape[0]
        self.row_index = row_index  # [n, q] absolute row of each query token
        self.pos_index = pos_index  # [n, q] absolute position (or the sink column)
        self.view_len = view_len

    def update(
        self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        keys = self.cache.keys[layer_idx]
        values = self.cache.values[layer_idx]
        # [n, heads, q, dim] -> [n, q, heads, dim], the shape advanced indexing addresses.
        keys[self.row_index, :, self.pos_index] = key_states.transpose(1, 2)
        values[self.row_index, :, self.pos_index] = value_states.transpose(1, 2)
        end = self.row0 + self.rows
        return (
            keys[self.row0 : end, :, : self.view_len],
            values[self.row0 : end, :, : self.view_len],
        )
