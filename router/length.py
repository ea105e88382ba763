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
        if self.snapshot_path is not None and self.observations % self.snapshot_every == 0:
            self.save(self.snapshot_path)

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
