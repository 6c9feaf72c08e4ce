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

from dsp_core.ops.llm import sample_tokens


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
        # Greedy draws nothing: no generator, and numpy.random (5 ms of imports) stays unloaded.
        self._rng = None if sampling.greedy else np.random.default_rng(sampling.seed)

    def draws(self, k: int) -> Any:
        """The uniforms of the next ``k`` tokens, [k, B] (None when greedy: nothing random)."""
        if self._rng is None:
            return None
        return self.xp.asarray(self._rng.random((k, self.batch)))

    def pick(self, logits: Any, uniform: Any = None) -> Any:
        """The chosen token of each row, int64 [B] (an array: nothing goes to the host).

        Computed in the namespace of ``logits`` (numpy, or cupy for device logits), by the
        same code as the in-plan ``dsp::Sample`` op (dsp_core.ops.llm.sample_tokens).
        """
        xp = namespace_of(logits, self.xp)
        s = self.sampling
        u = None if s.greedy else xp.asarray(uniform)
        return sample_tokens(xp, logits, u, s.temperature, s.top_k, s.top_p)


def namespace_of(x: Any, default: Any = np) -> Any:
    """numpy for host arrays, cupy for device arrays (``__cuda_array_interface__``), else ``default``."""
    if isinstance(x, np.ndarray):
        return np
    if hasattr(x, "__cuda_array_interface__"):
        import cupy

        return cupy
    return default
