"""The base of DSP's counter records (cache stats, lifecycle counters): plain int fields."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Counters:
    """A dataclass of int counters; subclasses only declare their fields."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
