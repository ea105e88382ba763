"""Ranker: (query, documents) -> one relevance score per document, batched by token length.

Two scorers behind one interface (``PairScorer``):

- ``CrossEncoderScorer``: ``AutoModelForSequenceClassification`` over (query, document)
  pairs, e.g. an ms-marco cross-encoder by Hugging Face id or path.
- ``LlmPointwiseScorer``: a causal LM asked "is this passage relevant?"; the score is
  logit(Yes) - logit(No) at the answer position. The packaged default is SmolLM2-135M-Instruct,
  because no cross-encoder ships offline.

Each query-document pair is one item; a request's pairs batch with other requests' pairs.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

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
from carpool.models import load_pretrained
from carpool.priority import apply_replica_priority
from carpool.server import BatchedModelServer
from carpool.serving import ServeBatching, make_collector
from carpool.threads import threaded_forward

DEFAULT_RANKER = "packaged:SmolLM2-135M-Instruct"
DEFAULT_LLM_PROMPT = (
    "Query: {query}\nPassage: {document}\nIs this passage relevant to the query? Answer Yes or No."
)
# Both spellings count: small models answer "Yes" or "yes" depending on the prompt.
DEFAULT_YES = ["Yes", "yes"]
DEFAULT_NO = ["No", "no"]

Pair = tuple[list[int], list[int] | None]  # input ids, token type ids (cross-encoders only)


class RankerConfig(StrictModel):
    """Everything a ranker replica needs; ``batching`` is its ``user_config``."""

    backend: Literal["llm", "cross_encoder"] = Field(
        default="llm",
        description="'cross_encoder' (sequence classification) or 'llm' (pointwise yes/no).",
    )
    source: ModelSourceConfig = Field(
        default_factory=lambda: ModelSourceConfig(model=DEFAULT_RANKER, max_length=512),
        description="Weights and device.",
    )
    prompt: str = Field(
        default=DEFAULT_LLM_PROMPT,
        max_length=4000,
        description="llm backend: user message with {query} and {document} placeholders.",
    )
    yes_tokens: list[str] = Field(default_factory=lambda: list(DEFAULT_YES), min_length=1)
    no_tokens: list[str] = Field(default_factory=lambda: list(DEFAULT_NO), min_length=1)
    gpu_memory_fraction: GpuMemoryFraction = None
    replica: ReplicaConfig = Field(default_factory=lambda: ReplicaConfig(num_cpus=0.5))
    batching: BatchingConfig = Field(
        default_factory=lambda: BatchingConfig(max_batch_size=32, max_batch_tokens=8192)
    )

    @model_validator(mode="after")
    def _gpu_memory_fraction_fits(self) -> RankerConfig:
        problem = gpu_memory_fraction_problem(
            self.gpu_memory_fraction, self.source.device, self.replica.num_gpus
        )
        if problem:
            raise ValueError(f"ranker: {problem}")
        return self

    @model_validator(mode="after")
    def _prompt_has_slots(self) -> RankerConfig:
        if self.backend == "llm":
            missing = [s for s in ("{query}", "{document}") if s not in self.prompt]
            if missing:
                raise ValueError(f"prompt must contain {missing}; got {self.prompt!r}")
        return self


class PairScorer(Protocol):
    """What the server needs from a scoring model; tests may pass any object that fits."""

    name: str
    max_length: int

    def encode(self, query: str, documents: list[str], truncate: bool) -> list[tuple[Pair, bool]]:
        """One encoded pair per document, with whether it was truncated."""
        ...

    def score(self, batch: list[Pair]) -> list[float]: ...


def _too_long(index: int, tokens: int, limit: int) -> RequestError:
    return RequestError(
        413,
        f"documents[{index}] with the query makes {tokens} tokens; this ranker takes at most "
        f"{limit}. Shorten it or set truncate: true",
        param=f"documents[{index}]",
        code="input_too_long",
    )


def _model_limit(config: ModelSourceConfig, model: Any, tokenizer: Any) -> int:
    if config.max_length is not None:
        return config.max_length
    limits = [
        getattr(model.config, "max_position_embeddings", None),
        tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None,
    ]
    return min(v for v in limits if v) if any(limits) else 512


class CrossEncoderScorer:
    """Sequence-classification cross-encoder; score = the relevance logit."""

    def __init__(self, config: RankerConfig, model: Any = None, tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self._torch = torch
        self.name = config.source.served_model_name or "ranker"
        src = config.source
        loaded = load_pretrained(
            src.model,
            AutoModelForSequenceClassification,
            src.device,
            src.dtype,
            model,
            tokenizer,
            gpu_memory_fraction=config.gpu_memory_fraction,
        )
        self.device, self.tokenizer, self.model = loaded.device, loaded.tokenizer, loaded.model
        self.max_length = _model_limit(config.source, self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # A fast tokenizer's truncation setting is state every call rewrites; requests
        # tokenize in worker threads, so a truncating call must not race an untruncated one
        # (the embedder saw uncut ids reach the model that way).
        self._tokenizer_lock = threading.Lock()

    def encode(self, query: str, documents: list[str], truncate: bool) -> list[tuple[Pair, bool]]:
        with self._tokenizer_lock:
            return self._encode(query, documents, truncate)

    def _encode(self, query: str, documents: list[str], truncate: bool) -> list[tuple[Pair, bool]]:
        full = self.tokenizer([query] * len(documents), documents, truncation=False)
        out: list[tuple[Pair, bool]] = []
        for i, ids in enumerate(full["input_ids"]):
            types = full["token_type_ids"][i] if "token_type_ids" in full else None
            if len(ids) <= self.max_length:
                out.append(((ids, types), False))
                continue
            if not truncate:
                raise _too_long(i, len(ids), self.max_length)
            try:
                cut = self.tokenizer(
                    query, documents[i], truncation="only_second", max_length=self.max_length
                )
            except Exception as exc:  # the query alone is over the limit
                raise RequestError(
                    413,
                    f"the query is too long for this ranker ({self.max_length} tokens with a "
                    "document); shorten it",
                    param="query",
                    code="input_too_long",
                ) from exc
            out.append(((cut["input_ids"], cut.get("token_type_ids")), True))
        return out

    def score(self, batch: list[Pair]) -> list[float]:
        torch = self._torch
        longest = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, (seq, seq_types) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            if seq_types is not None:
                types[row, : len(seq)] = torch.tensor(seq_types)
        inputs = {"input_ids": ids, "attention_mask": mask}
        if any(t is not None for _, t in batch):
            inputs["token_type_ids"] = types
        with torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in inputs.items()}).logits.float()
        # One logit: the relevance score. Two (not relevant / relevant): their difference.
        scores = logits[:, 0] if logits.shape[1] == 1 else logits[:, -1] - logits[:, 0]
        return [float(s) for s in scores.cpu()]


class LlmPointwiseScorer:
    """Causal LM judge: score = logsumexp(logits of yes tokens) - logsumexp(of no tokens).

    Pairs are right-padded so every real token keeps its position and, under causal attention,
    never sees padding: a pair scores the same alone or in any batch. Only the last real
    position goes through the LM head (the vocabulary projection is most of the cost otherwise).
    """

    _SLOT = "\ue000"  # private-use character: never in real text, marks where the document goes

    def __init__(self, config: RankerConfig, model: Any = None, tokenizer: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.name = config.source.served_model_name or "ranker"
        src = config.source
        loaded = load_pretrained(
            src.model,
            AutoModelForCausalLM,
            src.device,
            src.dtype,
            model,
            tokenizer,
            gpu_memory_fraction=config.gpu_memory_fraction,
        )
        self.device, self.tokenizer, self.model = loaded.device, loaded.tokenizer, loaded.model
        self.max_length = _model_limit(config.source, self.model, self.tokenizer)
        self.prompt = config.prompt
        self.yes_ids = self._first_token_ids(config.yes_tokens)
        self.no_ids = self._first_token_ids(config.no_tokens)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _first_token_ids(self, words: list[str]) -> list[int]:
        return sorted({self.tokenizer.encode(w, add_special_tokens=False)[0] for w in words})

    def _render(self, query: str) -> tuple[str, str]:
        user = self.prompt.replace("{query}", query).replace("{document}", self._SLOT)
        messages = [{"role": "user", "content": user}]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        else:
            text = user + "\nAnswer:"
        prefix, _, suffix = text.partition(self._SLOT)
        return prefix, suffix

    def encode(self, query: str, documents: list[str], truncate: bool) -> list[tuple[Pair, bool]]:
        prefix, suffix = self._render(query)
        head = self.tokenizer.encode(prefix, add_special_tokens=False)
        tail = self.tokenizer.encode(suffix, add_special_tokens=False)
        room = self.max_length - len(head) - len(tail)
        if room < 1:
            raise RequestError(
                413,
                f"the query takes {len(head) + len(tail)} tokens with the prompt; this ranker "
                f"takes at most {self.max_length}. Shorten the query",
                param="query",
                code="input_too_long",
            )
        docs = self.tokenizer(documents, add_special_tokens=False)["input_ids"]
        out: list[tuple[Pair, bool]] = []
        for i, doc in enumerate(docs):
            cut = len(doc) > room
            if cut and not truncate:
                raise _too_long(i, len(head) + len(doc) + len(tail), self.max_length)
            out.append(((head + doc[:room] + tail, None), cut))
        return out

    def score(self, batch: list[Pair]) -> list[float]:
        torch = self._torch
        longest = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        last = torch.tensor([len(seq) - 1 for seq, _ in batch])
        for row, (seq, _) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        with torch.no_grad():
            hidden = self.model.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
            ).last_hidden_state
            picked = hidden[torch.arange(len(batch)), last.to(self.device)]
            logits = self.model.lm_head(picked).float()
            yes = torch.logsumexp(logits[:, self.yes_ids], dim=1)
            no = torch.logsumexp(logits[:, self.no_ids], dim=1)
        return [float(s) for s in (yes - no).cpu()]


@dataclass
class RankResult:
    """Scores in document order, plus what the request cost."""

    scores: list[float]
    truncated: list[bool]
    total_tokens: int
    model: str


class RankingServer(BatchedModelServer[Pair, float]):
    """Plain-Python ranker server; tests use it without Ray."""

    stage = "ranker"

    def __init__(self, config: RankerConfig | dict | None = None, scorer: Any = None) -> None:
        self.config = (
            config
            if isinstance(config, RankerConfig)
            else RankerConfig.model_validate(config or {})
        )
        forward: Callable[[list[Pair]], list[float]] | None = None
        if scorer is None:
            cls = LlmPointwiseScorer if self.config.backend == "llm" else CrossEncoderScorer
            scorer = cls(self.config)
            forward = threaded_forward(scorer.score, self.config.replica)
        self.scorer: PairScorer = scorer
        self._init_batching(forward or self.scorer.score, self.config.batching)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.scorer.name,
            "backend": self.config.backend,
            "max_length": self.scorer.max_length,
        }

    async def rank(
        self,
        query: str,
        documents: list[str],
        truncate: bool = True,
        controls: RequestControls | None = None,
    ) -> RankResult:
        if not documents:
            raise RequestError(400, "no documents to rank; send at least one", param="documents")
        self.check_deadline(controls, "ranker", len(documents))
        chars = [len(query) + len(doc) for doc in documents]
        estimate = self.estimate_tokens(chars, self.scorer.max_length)
        with self.admitted(len(documents), estimate, controls) as ticket:
            # In a worker thread so tokenizing many documents does not stall the event loop.
            encoded = await asyncio.to_thread(self.scorer.encode, query, documents, truncate)
            pairs = [pair for pair, _ in encoded]
            lengths = [len(ids) for ids, _ in pairs]
            self.learn_token_ratio(
                sum(c for c, (_, cut) in zip(chars, encoded, strict=True) if not cut),
                sum(n for n, (_, cut) in zip(lengths, encoded, strict=True) if not cut),
            )
            scores = await self.run_job(self.make_job(pairs, lengths, controls), ticket)
        return RankResult(scores, [cut for _, cut in encoded], sum(lengths), self.scorer.name)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


class RankingDeployment(ServeBatching, RankingServer):
    """The Serve shell: ``@serve.batch`` collection and Ray metrics over ``RankingServer``."""

    _collect = make_collector()

    def __init__(self, config: dict) -> None:
        cfg = RankerConfig.model_validate(config)
        apply_replica_priority(
            cfg.replica.cpu_niceness, cfg.replica.cpu_scheduling, cfg.replica.cpu_cores
        )
        # On the GPUs Ray gave this replica, or a refusal naming the setting to change.
        RankingServer.__init__(self, place_replica(cfg, "torch"))
        self._init_serving(self.scorer.name)


def build_ranking_deployment(config: RankerConfig, name: str = "ranker") -> Application:
    """Applies the Serve options from ``config`` and binds the deployment."""
    options = config.replica.serve_options(name, config.batching)
    return (
        serve.deployment(RankingDeployment)
        .options(**options, user_config=config.batching.model_dump())
        # Batching goes only through user_config: were it in the constructor arguments too,
        # changing a knob would restart the replica instead of reconfiguring it in place.
        .bind(config.model_dump(exclude={"batching"}))
    )
