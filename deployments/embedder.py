"""Embedder: texts in, normalised vectors out, batched by token length.

``TextEmbedder`` is the model wrapper (tokenise; one padded forward pass for a list of
token-id lists). ``EmbeddingServer`` is plain Python: it turns a request into a ``Job`` and
hands it to the ``LengthAwareExecutor``, which merges concurrent jobs and runs length-sorted
passes. ``EmbeddingDeployment`` only adds ``@serve.batch`` collection and Ray metrics, and
``build_embedding_deployment`` applies the Serve options from config.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field
from ray import serve
from ray.serve.deployment import Application

from carpool.admission import RequestControls
from carpool.config import BatchingConfig, ModelSourceConfig, ReplicaConfig, StrictModel
from carpool.errors import RequestError
from carpool.models import load_pretrained, size_torch_threads
from carpool.server import BatchedModelServer
from carpool.serving import ServeBatching, make_collector

DEFAULT_EMBEDDER = "packaged:all-MiniLM-L6-v2"


class EmbedderConfig(StrictModel):
    """Everything an embedder replica needs; ``batching`` is its ``user_config``."""

    source: ModelSourceConfig = Field(
        default_factory=lambda: ModelSourceConfig(model=DEFAULT_EMBEDDER),
        description="Weights and device.",
    )
    pooling: Literal["mean", "cls"] = Field(
        default="mean", description="How token vectors become one vector (MiniLM: mean)."
    )
    normalize: bool = Field(default=True, description="L2-normalise embeddings.")
    replica: ReplicaConfig = Field(default_factory=lambda: ReplicaConfig(num_cpus=1.0))
    batching: BatchingConfig = Field(default_factory=BatchingConfig)


class EmbeddingModel(Protocol):
    """What the server needs from a model; tests may pass any object that fits."""

    name: str
    max_length: int
    dimension: int

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def truncate(self, text: str) -> list[int]: ...

    def embed_ids(self, batch: list[list[int]]) -> list[np.ndarray]: ...


def _sentence_transformers_max_length(folder: str) -> int | None:
    path = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(path):
        with open(path) as fh:
            value = json.load(fh).get("max_seq_length")
        return int(value) if value else None
    return None


class TextEmbedder:
    """A transformers encoder with pooling; pads each pass to its longest item."""

    def __init__(self, config: EmbedderConfig, model: Any = None, tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModel

        self._torch = torch
        self.name = config.source.served_model_name or "embedder"
        src = config.source
        loaded = load_pretrained(src.model, AutoModel, src.device, src.dtype, model, tokenizer)
        self.device, self.tokenizer, self.model = loaded.device, loaded.tokenizer, loaded.model
        tokenizer = loaded.tokenizer
        st_max = _sentence_transformers_max_length(loaded.path) if loaded.path else None
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
        self.pooling = config.pooling
        self.normalize = config.normalize
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]

    def truncate(self, text: str) -> list[int]:
        return self.tokenizer(
            text, add_special_tokens=True, truncation=True, max_length=self.max_length
        )["input_ids"]

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
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return list(pooled.cpu().numpy().astype(np.float32))


@dataclass
class EmbedResult:
    """One request's embeddings, in input order."""

    vectors: list[np.ndarray]
    token_counts: list[int]
    truncated: list[bool]
    model: str


class EmbeddingServer(BatchedModelServer[list[int], np.ndarray]):
    """Plain-Python embedder server; tests use it without Ray."""

    def __init__(self, config: EmbedderConfig | dict | None = None, model: Any = None) -> None:
        self.config = (
            config
            if isinstance(config, EmbedderConfig)
            else EmbedderConfig.model_validate(config or {})
        )
        if model is None:
            size_torch_threads(self.config.replica.num_cpus, self.config.replica.torch_threads)
            model = TextEmbedder(self.config)
        self.model: EmbeddingModel = model
        self._init_batching(self.model.embed_ids, self.config.batching)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "dimension": self.model.dimension,
            "max_length": self.model.max_length,
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
                    ids[i] = self.model.truncate(texts[i])
                    truncated[i] = True
            lengths = [len(s) for s in ids]
            vectors = await self.run_job(self.make_job(ids, lengths, controls), ticket)
        return EmbedResult(vectors, lengths, truncated, self.model.name)


class EmbeddingDeployment(ServeBatching, EmbeddingServer):
    """The Serve shell: ``@serve.batch`` collection and Ray metrics over ``EmbeddingServer``."""

    _collect = make_collector()

    def __init__(self, config: dict) -> None:
        EmbeddingServer.__init__(self, config)
        self._init_serving(self.model.name)


def build_embedding_deployment(config: EmbedderConfig, name: str = "embedder") -> Application:
    """Applies the Serve options from ``config`` and binds the deployment."""
    options = config.replica.serve_options(name, config.batching)
    return (
        serve.deployment(EmbeddingDeployment)
        .options(**options, user_config=config.batching.model_dump())
        # Batching goes only through user_config: were it in the constructor arguments too,
        # changing a knob would restart the replica instead of reconfiguring it in place.
        .bind(config.model_dump(exclude={"batching"}))
    )
