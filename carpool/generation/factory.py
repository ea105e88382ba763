"""Picks and builds a generation engine by name: the one model-loading path of a generator.

``load_engine`` reads a generator's config (``carpool.generation.config.GeneratorConfig``),
loads the tokenizer, and for carpool's own engines the transformers model (vLLM loads its
weights itself), and returns the engine with what the server needs beside it. ``make_engine`` builds an engine
around a model already in memory (scripts and tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from carpool.generation.assembly import EngineCore
from carpool.generation.config import DEFAULT_MAX_SEQ_LEN, ENGINE_MODES, GeneratorConfig
from carpool.generation.runner import kv_geometry
from carpool.generation.scheduler import SchedulerLimits
from carpool.generation.sequence import TokenizerInfo

logger = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    """An engine and what a server keeps beside it."""

    engine: EngineCore
    tokenizer: Any
    model: Any  # the transformers model (None for vLLM)
    vocab_size: int  # rows of the logits (the output layer's size, may exceed the tokenizer's)
    max_seq_len: int
    bytes_per_token: int  # KV cache bytes one token takes


def kv_bytes_per_token(model_config: Any, itemsize: int) -> int:
    """KV cache bytes one token takes: keys and values, every layer, every KV head."""
    layers, kv_heads, head_dim = kv_geometry(model_config)
    return 2 * layers * kv_heads * head_dim * itemsize


def check_kv_budget(
    max_num_seqs: int, max_seq_len: int, bytes_per_token: int, max_kv_cache_mb: int
) -> int:
    """Returns the KV bytes the settings may use, or raises with what to lower."""
    need = max_num_seqs * (max_seq_len + 1) * bytes_per_token
    if need > max_kv_cache_mb * 2**20:
        raise ValueError(
            f"KV cache would need up to {need / 2**20:.0f} MiB (max_num_seqs {max_num_seqs} x "
            f"max_seq_len {max_seq_len} x {bytes_per_token} bytes/token), above "
            f"max_kv_cache_mb {max_kv_cache_mb}; lower max_num_seqs or limits.max_seq_len, "
            "or raise limits.max_kv_cache_mb"
        )
    return need


def max_seq_len_for(cfg: GeneratorConfig, model_config: Any) -> int:
    """The configured context limit, else the model's capped at ``DEFAULT_MAX_SEQ_LEN``."""
    if cfg.mode == "vllm" and cfg.vllm.max_model_len:
        return int(cfg.vllm.max_model_len)
    if cfg.limits.max_seq_len is not None:
        return cfg.limits.max_seq_len
    if cfg.source.max_length is not None:
        return cfg.source.max_length
    text = model_config.get_text_config()
    model_limit = getattr(text, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    return min(model_limit, DEFAULT_MAX_SEQ_LEN)


def load_engine(cfg: GeneratorConfig, model: Any = None, tokenizer: Any = None) -> LoadedEngine:
    """Builds the engine a generator config names; ``model``/``tokenizer`` skip loading them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from carpool.devices import pick_device, pick_dtype
    from carpool.models import resolve_model_source
    from carpool.threads import size_torch_threads

    limits = SchedulerLimits(cfg.batching.max_num_seqs, cfg.batching.max_step_tokens)
    path = (
        None
        if model is not None and tokenizer is not None
        else resolve_model_source(cfg.source.model)
    )
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if cfg.mode == "vllm":
        return _load_vllm(cfg, path or resolve_model_source(cfg.source.model), tokenizer, limits)
    if model is None:
        size_torch_threads(cfg.replica.num_cpus, cfg.replica.torch_threads)
        device = pick_device(cfg.source.device)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=pick_dtype(cfg.source.dtype, device)
        ).to(device)
    model = model.eval()
    head = model.get_output_embeddings()
    vocab_size = int(
        head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size
    )
    max_seq_len = max_seq_len_for(cfg, model.config)
    bytes_per_token = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
    check_kv_budget(
        cfg.batching.max_num_seqs, max_seq_len, bytes_per_token, cfg.limits.max_kv_cache_mb
    )
    engine = make_engine(
        cfg.mode,
        model,
        TokenizerInfo.from_tokenizer(tokenizer, getattr(model, "generation_config", None)),
        limits,
        max_seq_len,
        cfg.limits.kv_block_size,
        prefix_cache_bytes=cfg.limits.prefix_cache_mb * 1024 * 1024,
    )
    return LoadedEngine(engine, tokenizer, model, vocab_size, max_seq_len, bytes_per_token)


def _load_vllm(
    cfg: GeneratorConfig, path: str, tokenizer: Any, limits: SchedulerLimits
) -> LoadedEngine:
    """mode 'vllm': vLLM loads and places the weights; this side keeps the tokenizer.

    No transformers model is loaded (on a GPU it would hold a second copy), and carpool's
    KV budget check does not apply: vLLM sizes its cache from gpu_memory_utilization (or
    VLLM_CPU_KVCACHE_SPACE on CPU) and refuses to start when max_model_len does not fit.
    """
    from transformers import AutoConfig, GenerationConfig

    from carpool.devices import pick_device
    from carpool.generation.vllm_engine import VllmEngine
    from carpool.generation.vllm_options import resolve_dtype

    model_config = AutoConfig.from_pretrained(path)
    max_seq_len = max_seq_len_for(cfg, model_config)
    device = pick_device(cfg.source.device)
    dtype = resolve_dtype(cfg.vllm.dtype, cfg.source.dtype, device)
    bytes_per_token = kv_bytes_per_token(model_config, 4 if dtype == "float32" else 2)
    generation_config = None
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except Exception:  # no generation_config.json: the tokenizer's eos is enough
        logger.debug("no generation config in %s", path, exc_info=True)
    engine = VllmEngine(
        path,
        cfg.vllm,
        TokenizerInfo.from_tokenizer(tokenizer, generation_config),
        limits,
        max_seq_len,
        dtype,
        bytes_per_token,
        device,
    )
    vocab_size = int(model_config.get_text_config().vocab_size)
    return LoadedEngine(engine, tokenizer, None, vocab_size, max_seq_len, bytes_per_token)


def make_engine(
    mode: str,
    model: Any,
    tokenizer: TokenizerInfo,
    limits: SchedulerLimits,
    max_seq_len: int,
    block_size: int = 64,
    queue_policy: str = "priority",
    packed_weights: bool = True,
    prefix_cache_bytes: int = 0,
) -> EngineCore:
    """One of carpool's own engines around a model in memory (vLLM: ``load_engine``).

    ``packed_weights``: mode 'continuous' on CPU in float32 runs its passes on a twin of
    the model with oneDNN-packed linear weights (``runner.pack_linears``; faster, costs a
    second copy of those weights). ``prefix_cache_bytes``: mode 'continuous' keeps finished
    sequences' prefixes up to this size (``prefix_cache.py``; 0: none).
    """
    if mode == "continuous":
        from carpool.generation.native import ContinuousEngine
        from carpool.generation.prefix_cache import PrefixCache
        from carpool.generation.runner import SlotRunner

        runner = SlotRunner(
            model,
            limits.max_num_seqs,
            max_seq_len,
            block_size,
            tokenizer.pad_id,
            packed_weights=packed_weights,
        )
        prefixes = PrefixCache(prefix_cache_bytes, block_size) if prefix_cache_bytes else None
        return ContinuousEngine(runner, tokenizer, limits, max_seq_len, queue_policy, prefixes)
    if mode == "static":
        from carpool.generation.static import StaticEngine

        return StaticEngine(model, tokenizer, limits, max_seq_len, block_size)
    if mode == "vllm":
        raise ValueError("mode 'vllm' loads its own weights: build it with load_engine(config)")
    raise ValueError(f"unknown engine mode {mode!r}; choose one of {ENGINE_MODES}")
