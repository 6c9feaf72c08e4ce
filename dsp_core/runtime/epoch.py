"""A process-wide count of the rare events after which no IO binding may replay as it was bound.

``CompiledModel.bind`` hands out a step that replays a plan's steady program on its own
buffers (``PlanRuntime.bound_step``). Besides its plan moving off that program (which the
step sees itself), a step must stop when diagnostics turn on (they observe the full path)
or a constant is replaced (a weight the program read at capture). Those events are rare,
so they are pushed here, not asked for on each call: each one adds one to ``EPOCH[0]``, and
a step compares that one integer with the count it was made under. A step that finds it
changed takes the full path once, and its binding makes a new step there.

Asking on each call (a module flag, the plan's constants table and its change count, one
by one) cost the replay of a 45 µs CNN about 1 µs: after a call of that size those objects
are out of the cache. This module imports nothing, so any part of the core can signal.
"""

from __future__ import annotations

EPOCH = [0]


def bump() -> None:
    """Invalidate every bound step made so far (each takes the full path once, then is made again)."""
    EPOCH[0] += 1
