"""Token choice: greedy, or temperature / top-k / top-p sampling with a seed.

Everything here is array code over a namespace ``xp`` (numpy on the CPU, cupy on a GPU):
a chosen token stays an array and is written back into the decode plan's ``input_ids``
in place, so the host never converts a token mid-block. The random numbers of a block
are drawn up front (``draws(k)``), one uniform per token and row, from a seeded
generator: the same seed gives the same tokens whatever the block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` (the default) is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature 0)."""
        return self.temperature <= 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self.temperature}, "
                f"{self.top_k}, {self.top_p}"
            )


GREEDY = Sampling()


class Sampler:
    """Chooses tokens for a batch; one per row per call, from logits [B, V] and uniforms [B]."""

    def __init__(self, sampling: Sampling, batch: int, xp: Any = np) -> None:
        self.sampling = sampling
        self.batch = batch
        self.xp = xp
        self._rng = np.random.default_rng(sampling.seed)

    def draws(self, k: int) -> Any:
        """The uniforms of the next ``k`` tokens, [k, B] (None when greedy: nothing random)."""
        if self.sampling.greedy:
            return None
        return self.xp.asarray(self._rng.random((k, self.batch)))

    def pick(self, logits: Any, uniform: Any = None) -> Any:
        """The chosen token of each row, int64 [B] (an array: nothing goes to the host).

        Computed in the namespace of ``logits`` (numpy, or cupy for device logits).
        """
        xp = namespace_of(logits, self.xp)
        if self.sampling.greedy:
            return xp.argmax(logits, axis=-1).astype(xp.int64)
        s = self.sampling
        x = logits.astype(xp.float64) / s.temperature
        vocab = x.shape[-1]
        if 0 < s.top_k < vocab:
            kth = -xp.partition(-x, s.top_k - 1, axis=-1)[:, s.top_k - 1 : s.top_k]
            x = xp.where(x < kth, -xp.inf, x)
        if s.top_p < 1.0:
            order = xp.argsort(-x, axis=-1)
            ranked = xp.take_along_axis(x, order, axis=-1)
            probs = _softmax(xp, ranked)
            before = xp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
            ranked = xp.where(before >= s.top_p, -xp.inf, ranked)  # the best token always stays
            x = xp.empty_like(x)
            x[xp.arange(x.shape[0])[:, None], order] = ranked  # put_along_axis, in numpy and cupy alike
        cdf = xp.cumsum(_softmax(xp, x), axis=-1)
        target = xp.asarray(uniform).reshape(-1, 1) * cdf[:, -1:]
        chosen = (cdf <= target).sum(axis=-1)
        return xp.minimum(chosen, vocab - 1).astype(xp.int64)


def namespace_of(x: Any, default: Any = np) -> Any:
    """numpy for host arrays, cupy for device arrays (``__cuda_array_interface__``), else ``default``."""
    if isinstance(x, np.ndarray):
        return np
    if hasattr(x, "__cuda_array_interface__"):
        import cupy

        return cupy
    return default


def _softmax(xp: Any, x: Any) -> Any:
    shifted = x - x.max(axis=-1, keepdims=True)
    e = xp.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)
