"""Decode metrics: tokens/s overall, decode (step >= 1), steady (step >= 3), lateSteady (step >= 20).

Step 0 is the token the prefill produced (its time includes the prefill); step k >= 1
is the k-th decode step. A decode block of K steps is timed as a whole (the host does
not look mid-block), and each of its tokens is charged an equal share. The effective
score prefers lateSteady, then steady, decode and overall: the first one with tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# metric name -> first step it counts
THRESHOLDS: dict[str, int] = {"overall": 0, "decode": 1, "steady": 3, "lateSteady": 20}
PREFERENCE = ("lateSteady", "steady", "decode", "overall")


@dataclass(frozen=True)
class DecodeMetrics:
    """Per-step seconds of one generation, and the tokens/s derived from them."""

    step_seconds: tuple[float, ...]
    batch: int = 1

    def rate(self, first_step: int) -> float | None:
        """Tokens/s over the steps from ``first_step`` on (None when there are none)."""
        times = self.step_seconds[first_step:]
        spent = sum(times)
        if not times or spent <= 0:
            return None
        return len(times) * self.batch / spent

    @property
    def rates(self) -> dict[str, float | None]:
        """Every metric by name."""
        return {name: self.rate(step) for name, step in THRESHOLDS.items()}

    @property
    def effective(self) -> tuple[str, float | None]:
        """(name, tokens/s) of the preferred metric that has tokens."""
        rates = self.rates
        for name in PREFERENCE:
            if rates[name] is not None:
                return name, rates[name]
        return "overall", None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form: the four rates, the effective one, the step count."""
        name, value = self.effective
        return {
            **{f"{k}_tokens_per_s": v for k, v in self.rates.items()},
            "effective": {"metric": name, "tokens_per_s": value},
            "steps": len(self.step_seconds),
            "batch": self.batch,
            "seconds": sum(self.step_seconds),
        }
