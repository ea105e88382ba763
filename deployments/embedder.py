"""Embedder: texts in, normalised vectors out, batched by token length.

``TextEmbedder`` is the model wrapper (tokenise; one padded forward pass for a list of
token-id lists). ``EmbeddingServer`` is plain Python: it turns a request into a ``Job`` and
hands it to the ``LengthAwareExecutor``, which merges concurrent jobs and runs length-sorted
passes. ``EmbeddingDeployment`` only adds ``@serve.batch`` collection and Ray metrics, and
``build_embedding_deployment`` applies the Serve options from config.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field, model_validator
from ray import serve
from ray.serve.deployment import Application

from carpool.admission import RequestControls
from carpool.config import (
    BatchingConfig,
    GpuMemoryFraction,
    ModelSourceConfig,
    ReplicaConfig,
    StrictModel,
)
from carpool.devices import gpu_memory_fraction_problem, place_replica
from carpool.errors import RequestError
from carpool.models import load_pretrained, resolve_pooling, sentence_transformers_max_length
from carpool.priority import apply_replica_priority
from carpool.server import BatchedModelServer
from carpool.serving import ServeBatching, make_collector
from carpool.threads import threaded_forward

DEFAULT_EMBEDDER = "packaged:all-MiniLM-L6-v2"


class EmbedderConfig(StrictModel):
    """Everything an embedder replica needs; ``batching`` is its ``user_config``."""

    source: ModelSourceConfig = Field(
        default_factory=lambda: ModelSourceConfig(model=DEFAULT_EMBEDDER),
        description="Weights and device.",
    )
    pooling: Literal["cls", "mean", "max", "lasttoken"] | None = Field(
        default=None,
        description="How token vectors become one vector. Unset: what the model folder's "
        "sentence-transformers Pooling config (1_Pooling/config.json) says; without one, "
        "mean for BERT-family encoders, and a refusal at start-up for any other model. Set "
        "it to override the folder.",
    )
    normalize: bool = Field(default=True, description="L2-normalise embeddings.")
    gpu_memory_fraction: GpuMemoryFraction = None
    replica: ReplicaConfig = Field(default_factory=lambda: ReplicaConfig(num_cpus=1.0))
    batching: BatchingConfig = Field(default_factory=BatchingConfig)

    @model_validator(mode="after")
    def _gpu_memory_fraction_fits(self) -> EmbedderConfig:
        problem = gpu_memory_fraction_problem(
            self.gpu_memory_fraction, self.source.device, self.replica.num_gpus
        )
        if problem:
            raise ValueError(f"embedder: {problem}")
        return self


class EmbeddingModel(Protocol):
    """What the server needs from a model; tests may pass any object that fits."""

    name: str
    max_length: int
    dimension: int

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def truncate(self, text: str) -> list[int]: ...

    def embed_ids(self, batch: list[list[int]]) -> list[np.ndarray]: ...


# Said in every refusal of token ids that cannot be the model's: the one client known to send
# foreign ids by default, and the setting that makes it send text.
FOREIGN_IDS_HINT = (
    "token ids must come from this model's own tokenizer (special tokens included); send "
    "text instead if you cannot (LangChain OpenAIEmbeddings sends tiktoken ids: set "
    "check_embedding_ctx_length=False)"
)


class TextEmbedder:
    """A transformers encoder with pooling; pads each pass to its longest item."""

    def __init__(self, config: EmbedderConfig, model: Any = None, tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModel

        self._torch = torch
        self.name = config.source.served_model_name or "embedder"
        src = config.source
        loaded = load_pretrained(
            src.model,
            AutoModel,
            src.device,
            src.dtype,
            model,
            tokenizer,
            gpu_memory_fraction=config.gpu_memory_fraction,
        )
        self.device, self.tokenizer, self.model = loaded.device, loaded.tokenizer, loaded.model
        tokenizer = loaded.tokenizer
        st_max = sentence_transformers_max_length(loaded.path) if loaded.path else None
        limits = [
            config.source.max_length,
            st_max,
            getattr(self.model.config, "max_position_embeddings", None),
            tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None,
        ]
        self.max_length = min(v for v in limits if v) if any(limits) else 512
        if config.source.max_length is not None:
            self.max_length = config.source.max_length
        self.dimension = int(self.model.config.hidden_size)
        self.vocab_size = int(
            getattr(self.model.config, "vocab_size", None) or len(loaded.tokenizer)
        )
        self.pooling = resolve_pooling(
            config.pooling,
            loaded.path,
            getattr(self.model.config, "model_type", None),
        )
        self.normalize = config.normalize
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # A fast tokenizer keeps its truncation setting as state that every call rewrites, so
        # a truncating call racing another request's tokenize (worker threads) came back
        # uncut: 162 ids reached a 128-position model. One call at a time.
        self._tokenizer_lock = threading.Lock()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        with self._tokenizer_lock:
            return self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]

    def truncate(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            ids = self.tokenizer(
                text, add_special_tokens=True, truncation=True, max_length=self.max_length
            )["input_ids"]
        return ids[: self.max_length]

    def embed_ids(self, batch: list[list[int]]) -> list[np.ndarray]:
        torch = self._torch
        longest = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            pooled = pool(hidden, mask, self.pooling)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return list(pooled.cpu().numpy().astype(np.float32))


def pool(hidden: Any, mask: Any, mode: str) -> Any:
    """One vector per row of ``hidden`` (batch x length x dim), right-padded per ``mask``."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        import torch

        last = mask.sum(1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        # Padding never wins: as sentence-transformers, it is set far below any real value.
        return hidden.masked_fill(weights == 0, -1e9).max(1).values
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


@dataclass
class EmbedResult:
    """One request's embeddings, in input order."""

    vectors: list[np.ndarray]
    token_counts: list[int]
    truncated: list[bool]
    model: str


class EmbeddingServer(BatchedModelServer[list[int], np.ndarray]):
    """Plain-Python embedder server; tests use it without Ray."""

    stage = "embedder"

    def __init__(self, config: EmbedderConfig | dict | None = None, model: Any = None) -> None:
        self.config = (
            config
            if isinstance(config, EmbedderConfig)
            else EmbedderConfig.model_validate(config or {})
        )
        forward: Callable[[list[list[int]]], list[np.ndarray]] | None = None
        if model is None:
            model = TextEmbedder(self.config)
            forward = threaded_forward(model.embed_ids, self.config.replica)
        self.model: EmbeddingModel = model
        self._init_batching(forward or self.model.embed_ids, self.config.batching)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "dimension": self.model.dimension,
            "max_length": self.model.max_length,
            "pooling": getattr(self.model, "pooling", None),
        }

    async def embed(
        self, texts: list[str], truncate: bool = True, controls: RequestControls | None = None
    ) -> EmbedResult:
        if not texts:
            raise RequestError(400, "no texts to embed; send at least one", param="input")
        self.check_deadline(controls, "embedder", len(texts))
        chars = [len(t) for t in texts]
        estimate = self.estimate_tokens(chars, self.model.max_length)
        with self.admitted(len(texts), estimate, controls) as ticket:
            # In a worker thread: a request of many long texts must not stall the replica's
            # event loop, which keeps collecting other requests meanwhile.
            ids = await asyncio.to_thread(self.model.tokenize, texts)
            self.learn_token_ratio(sum(chars), sum(len(seq) for seq in ids))
            truncated = [False] * len(ids)
            for i, seq in enumerate(ids):
                if len(seq) > self.model.max_length:
                    if not truncate:
                        raise RequestError(
                            413,
                            f"input[{i}] has {len(seq)} tokens; this model takes at most "
                            f"{self.model.max_length}. Shorten it or set truncate: true",
                            param=f"input[{i}]",
                            code="input_too_long",
                        )
                    truncated[i] = True
            cut = [i for i, flag in enumerate(truncated) if flag]
            if cut:  # in a worker thread too: the tokenizer may be busy with another request
                again = await asyncio.to_thread(
                    lambda: [self.model.truncate(texts[i]) for i in cut]
                )
                for i, seq in zip(cut, again, strict=True):
                    ids[i] = seq
            lengths = [len(s) for s in ids]
            vectors = await self.run_job(self.make_job(ids, lengths, controls), ticket)
        return EmbedResult(vectors, lengths, truncated, self.model.name)

    async def embed_tokens(
        self,
        inputs: list[list[int]],
        truncate: bool = True,
        controls: RequestControls | None = None,
    ) -> EmbedResult:
        """Embeds inputs given as the model's token ids; they reach the model as sent.

        Ids outside the vocabulary cannot be this model's (LangChain's default sends tiktoken
        ids) and are refused, naming the item; an input over the model's limit is cut to its
        first ``max_length`` ids (flagged ``truncated``) or refused with 413.
        """
        if not inputs or any(not ids for ids in inputs):
            raise RequestError(400, "no token ids to embed; send at least one", param="input")
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None:
            for i, ids in enumerate(inputs):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise RequestError(
                        400,
                        f"input[{i}] holds token id {bad}, outside this model's vocabulary "
                        f"(0 to {vocab - 1}); {FOREIGN_IDS_HINT}",
                        param=f"input[{i}]",
                        code="invalid_token_ids",
                    )
        self.check_deadline(controls, "embedder", len(inputs))
        limit = self.model.max_length
        ids = [list(seq) for seq in inputs]
        truncated = [len(seq) > limit for seq in ids]
        for i, cut in enumerate(truncated):
            if cut:
                if not truncate:
                    raise RequestError(
                        413,
                        f"input[{i}] has {len(ids[i])} tokens; this model takes at most "
                        f"{limit}. Shorten it or set truncate: true",
                        param=f"input[{i}]",
                        code="input_too_long",
                    )
                ids[i] = ids[i][:limit]
        lengths = [len(s) for s in ids]
        with self.admitted(len(ids), sum(lengths), controls) as ticket:
            vectors = await self.run_job(self.make_job(ids, lengths, controls), ticket)
        return EmbedResult(vectors, lengths, truncated, self.model.name)


class EmbeddingDeployment(ServeBatching, EmbeddingServer):
    """The Serve shell: ``@serve.batch`` collection and Ray metrics over ``EmbeddingServer``."""

    _collect = make_collector()

    def __init__(self, config: dict) -> None:
        cfg = EmbedderConfig.model_validate(config)
        apply_replica_priority(
            cfg.replica.cpu_niceness, cfg.replica.cpu_scheduling, cfg.replica.cpu_cores
        )
        # On the GPUs Ray gave this replica, or a refusal naming the setting to change.
        EmbeddingServer.__init__(self, place_replica(cfg, "torch"))
        self._init_serving(self.model.name)


def build_embedding_deployment(
    config: EmbedderConfig,
    name: str = "embedder",
    deployment_cls: type[EmbeddingDeployment] = EmbeddingDeployment,
    bind_args: Sequence[Any] = (),
) -> Application:
    """Applies the Serve options from ``config`` and binds the deployment (a subclass, such
    as the embed app's direct ingress, gets ``bind_args`` after the config)."""
    options = config.replica.serve_options(name, config.batching)
    return (
        serve.deployment(deployment_cls)
        .options(**options, user_config=config.batching.model_dump())
        # Batching goes only through user_config: were it in the constructor arguments too,
        # changing a knob would restart the replica instead of reconfiguring it in place.
        .bind(config.model_dump(exclude={"batching"}), *bind_args)
    )
