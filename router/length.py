"""Output-length prediction: a heuristic prior that learns online from every completion.

``LengthPredictor`` is Bayesian linear regression on log(1 + output tokens). The prior mean
encodes the heuristics (instruction cues, ``max_tokens``), and the prior's strength says how
many observations it is worth. Each completed request updates the posterior exactly, in
closed form, so the predictor is useful from the first request and well fitted after a few
hundred. Its state (two small matrices) snapshots to JSON, so a restarted replica keeps what
it learned.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path

import numpy as np

from router.features import CUE_NAMES, CUES, RequestFeatures

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1


class LengthPredictor:
    """Predicts output tokens; ``observe()`` learns from what a request really produced."""

    def __init__(
        self,
        default_tokens: float = 48.0,
        prior_strength: float = 4.0,
        embedding_dims: int = 0,
        embedding_source_dims: int = 384,
        snapshot_path: str | os.PathLike[str] | None = None,
        snapshot_every: int = 20,
        seed: int = 0,
    ) -> None:
        if default_tokens < 1 or prior_strength <= 0:
            raise ValueError(
                f"default_tokens must be >= 1 and prior_strength > 0; got {default_tokens}, "
                f"{prior_strength}"
            )
        self.embedding_dims = embedding_dims
        # A fixed random projection keeps embeddings' contribution small enough to learn
        # from a few hundred samples (384 weights would need thousands).
        rng = np.random.default_rng(seed)
        self._projection = (
            rng.standard_normal((embedding_source_dims, embedding_dims)) / math.sqrt(embedding_dims)
            if embedding_dims
            else None
        )
        prior = [math.log1p(default_tokens), 0.0, 0.15, 0.1, *(CUES[n][1] for n in CUE_NAMES)]
        prior += [0.0] * embedding_dims
        self.prior_mean = np.array(prior)
        self.dims = len(prior)
        self.prior_strength = prior_strength
        self._precision = np.eye(self.dims) * prior_strength
        self._moment = self._precision @ self.prior_mean
        self._weights = self.prior_mean.copy()
        self.observations = 0
        # What this predictor learned itself: since its last merge (pending) and in all (own),
        # for merging with other router replicas (PredictorStore).
        self._pending = _Learned.zero(self.dims)
        self._own = _Learned.zero(self.dims)
        self.snapshot_path = Path(snapshot_path) if snapshot_path else None
        self.snapshot_every = snapshot_every
        if self.snapshot_path is not None and self.snapshot_path.exists():
            self.load(self.snapshot_path)

    def _x(self, features: RequestFeatures) -> np.ndarray:
        x = features.vector()
        if self.embedding_dims:
            if features.embedding is None:
                x += [0.0] * self.embedding_dims
            else:
                x += list(np.asarray(features.embedding) @ self._projection)
        return np.asarray(x)

    def predict_log(self, features: RequestFeatures) -> float:
        return float(self._x(features) @ self._weights)

    def predict(self, features: RequestFeatures) -> float:
        """Expected output tokens, within [1, max_tokens]."""
        tokens = math.expm1(self.predict_log(features))
        return float(min(max(tokens, 1.0), features.max_tokens))

    def observe(self, features: RequestFeatures, output_tokens: int) -> None:
        """Learns from a completed request (a request cut at ``max_tokens`` counts as that)."""
        x = self._x(features)
        y = math.log1p(max(output_tokens, 0))
        self._precision += np.outer(x, x)
        self._moment += x * y
        self._weights = np.linalg.solve(self._precision, self._moment)
        self.observations += 1
        for learned in (self._pending, self._own):
            learned.add(x, y)
        if self.snapshot_path is not None and self.observations % self.snapshot_every == 0:
            self.save(self.snapshot_path)

    def take_learned(self) -> tuple[dict, dict]:
        """(learned since the last call, learned in all) by this predictor, as plain data."""
        pending = self._pending.as_dict()
        self._pending = _Learned.zero(self.dims)
        return pending, self._own.as_dict()

    def return_learned(self, pending: dict) -> None:
        """Puts back what ``take_learned`` returned when it could not be merged."""
        self._pending.precision += np.asarray(pending["precision"])
        self._pending.moment += np.asarray(pending["moment"])
        self._pending.observations += int(pending["observations"])

    def merge(self, learned: dict) -> None:
        """Adds what another predictor learned (``take_learned``'s output)."""
        self._precision += np.asarray(learned["precision"])
        self._moment += np.asarray(learned["moment"])
        self.observations += int(learned["observations"])
        self._weights = np.linalg.solve(self._precision, self._moment)
        if self.snapshot_path is not None and learned["observations"]:
            self.save(self.snapshot_path)

    def adopt(self, state: dict) -> None:
        """Takes a merged state (``state()`` of a PredictorStore), keeping what this predictor
        learned since it last called ``take_learned`` on top."""
        self._precision = np.asarray(state["precision"]) + self._pending.precision
        self._moment = np.asarray(state["moment"]) + self._pending.moment
        self.observations = int(state["observations"]) + self._pending.observations
        self._weights = np.linalg.solve(self._precision, self._moment)

    def state(self) -> dict:
        return {
            "version": SNAPSHOT_VERSION,
            "dims": self.dims,
            "observations": self.observations,
            "precision": self._precision.tolist(),
            "moment": self._moment.tolist(),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Atomic write: a crash mid-save leaves the previous snapshot intact."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.state(), fh)
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike[str]) -> bool:
        """Restores learned state; a snapshot of another shape is ignored with a warning."""
        try:
            state = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            logger.warning(
                "length predictor snapshot %s unreadable (%s); starting fresh", path, exc
            )
            return False
        if state.get("version") != SNAPSHOT_VERSION or state.get("dims") != self.dims:
            logger.warning(
                "length predictor snapshot %s has dims %s, this predictor %s; starting fresh",
                path,
                state.get("dims"),
                self.dims,
            )
            return False
        self._precision = np.asarray(state["precision"])
        self._moment = np.asarray(state["moment"])
        self._weights = np.linalg.solve(self._precision, self._moment)
        self.observations = int(state["observations"])
        return True


class _Learned:
    """Sufficient statistics of some observations: what merging predictors add up."""

    def __init__(self, precision: np.ndarray, moment: np.ndarray, observations: int) -> None:
        self.precision, self.moment, self.observations = precision, moment, observations

    @classmethod
    def zero(cls, dims: int) -> _Learned:
        return cls(np.zeros((dims, dims)), np.zeros(dims), 0)

    def add(self, x: np.ndarray, y: float) -> None:
        self.precision += np.outer(x, x)
        self.moment += x * y
        self.observations += 1

    def as_dict(self) -> dict:
        return {
            "precision": self.precision.tolist(),
            "moment": self.moment.tolist(),
            "observations": self.observations,
        }


class PredictorStore:
    """One length predictor merged from every router replica's learning.

    Each replica sends what it learned since its last sync and gets the merged state back, so
    every replica predicts from all completions, exactly as one predictor would (the posterior
    is a sum over observations). The store may restart (Serve recreates the actor that holds
    it): a replica that finds a new ``epoch`` sends everything it learned instead, so nothing
    is counted twice or lost while any replica that learned it lives. With ``snapshot_path``
    the merged state also persists on the store's node.
    """

    def __init__(self, default_tokens: float = 48.0, snapshot_path: str | None = None) -> None:
        self.predictor = LengthPredictor(default_tokens=default_tokens, snapshot_path=snapshot_path)
        self.epoch = os.urandom(8).hex()

    def sync(self, epoch: str | None, pending: dict, own: dict) -> dict:
        self.predictor.merge(pending if epoch == self.epoch else own)
        return {"epoch": self.epoch, **self.predictor.state()}
