"""Tiny random models and request factories shared by the test tiers.

Tokenizers come from the packaged models (they install offline); weights are random and
tiny (2 layers, hidden 32), so every model builds in well under a second.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from carpool.models import resolve_model_source

WORDS = [
    "the",
    "a",
    "carpool",
    "batch",
    "token",
    "padding",
    "model",
    "serve",
    "ray",
    "query",
    "document",
    "answer",
    "city",
    "river",
    "mountain",
    "capital",
    "france",
    "paris",
    "music",
    "guitar",
    "market",
    "stock",
    "weather",
    "rain",
    "sun",
    "cloud",
]


def random_text(rng: random.Random, min_words: int = 1, max_words: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


def bert_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_source("packaged:all-MiniLM-L6-v2"))


def llama_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_source("packaged:SmolLM2-135M-Instruct"))


def tiny_bert_config(tokenizer, **overrides):
    from transformers import BertConfig

    values = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    values.update(overrides)
    return BertConfig(**values)


def tiny_llama_config(tokenizer, **overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def save_tiny_lm(path: Path, seed: int = 0, **config_overrides) -> str:
    """Saves a tiny random Llama with the test tokenizer at ``path``; returns the folder.

    A large init (0.5) by default: a random model that does not repeat one token, so a
    mix-up between sequences shows in their outputs.
    """
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = llama_tokenizer()
    torch.manual_seed(seed)
    config_overrides.setdefault("initializer_range", 0.5)
    LlamaForCausalLM(tiny_llama_config(tokenizer, **config_overrides)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_tiny_models(root: Path, seed: int = 0) -> dict[str, str]:
    """Saves a tiny encoder, cross-encoder and causal LM; returns their folders by role."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, LlamaForCausalLM

    torch.manual_seed(seed)
    out: dict[str, str] = {}
    bert_tok = bert_tokenizer()
    encoder = AutoModel.from_config(tiny_bert_config(bert_tok))
    path = root / "tiny-encoder"
    encoder.save_pretrained(path)
    bert_tok.save_pretrained(path)
    out["encoder"] = str(path)

    cross = AutoModelForSequenceClassification.from_config(tiny_bert_config(bert_tok, num_labels=1))
    path = root / "tiny-cross-encoder"
    cross.save_pretrained(path)
    bert_tok.save_pretrained(path)
    out["cross_encoder"] = str(path)

    llama_tok = llama_tokenizer()
    lm = LlamaForCausalLM(tiny_llama_config(llama_tok))
    path = root / "tiny-causal-lm"
    lm.save_pretrained(path)
    llama_tok.save_pretrained(path)
    out["causal_lm"] = str(path)
    return out


def pipeline_api(name: str) -> Any:
    """A pipeline's FastAPI app: the module's own, or, where the routes are built per replica
    over a handler (generate), built over none (its routes and middleware only)."""
    import importlib

    module = importlib.import_module(f"pipelines.{name}")
    if hasattr(module, "api"):
        return module.api
    return getattr(module, f"{name}_api")(None)
