"""IO binding: a replaying plan's own input and output buffers handed to the caller.

``CompiledModel.run`` copies each feed into the plan's staging buffer and each output out
of the plan's replay buffers, so the caller's arrays and DSP's never alias. For a loop that
feeds the same shapes again and again those two copies are most of what a call costs above
the work itself (on a GPU, a CuPy copy costs the host 5-20 µs; on a small CPU model the
copies and checks are DSP's per-call overhead). ``CompiledModel.bind(feeds)`` warms the
plan up on ``feeds`` and returns a ``Binding``: ``binding.inputs`` are the staging buffers
themselves (write new values into them in place), ``binding.run()`` replays the plan on them
and returns its replay buffers (valid until the next run: copy what you keep). When the plan
is not replaying its steady program at that moment (it was evicted, recaptured, a constant
was replaced, diagnostics are on), ``run`` takes the full path on the same arrays and
returns owned copies, so a binding is never wrong, only slower. The staging buffers are the
plan's: a ``model.run`` of the same shapes copies its feeds into them, so a caller mixing the two
writes the binding's inputs before each ``binding.run()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dsp_core.errors import InputError
from dsp_core.runtime.model import _as_output  # model imports this module only inside bind()
from dsp_core.runtime.plan_runtime import _owned

if TYPE_CHECKING:
    from dsp_core.cache.memory import ShapeSignature
    from dsp_core.runtime.model import CompiledModel
    from dsp_core.runtime.plan_runtime import PlanRuntime


class Binding:
    """A shape signature's staging buffers as inputs, its replay buffers as outputs.

    ``inputs``: name -> the array to write the next step's value into (in place:
    ``binding.inputs["x"][...] = new``; a numpy array, or a device array where the plan
    stages that input on its device). ``bound``: whether ``run`` replays without copies now.
    """

    def __init__(self, model: CompiledModel, feeds: Mapping[str, Any], settle: int) -> None:
        if model.variables:
            raise InputError(
                f"bind() warms the plan up with real steps, which would advance the variables "
                f"{sorted(model.variables)}: run the model with run(), or generate with GenerationPipeline"
            )
        if settle < 1:
            raise InputError(f"bind(settle={settle}): at least one warm-up step is needed")
        self._model = model
        self._names = model._default_outputs
        live = None
        for _ in range(settle):  # freeze, warm up, capture: until the plan replays its steady program
            model.run(feeds)
            live = model.last_live
            if live is not None and live.runtime._steady is not None:
                break
        self._signature: ShapeSignature | None = None
        self._runtime: PlanRuntime | None = None
        self._staged: list[tuple[int, Any]] | None = None
        names = {spec.flat: spec.name for spec in model._feeds}
        if live is not None and live.runtime is not None and live.runtime._steady is not None:
            runtime = live.runtime
            buffers = runtime.staging.buffers
            flats = [flat for flat, _, _ in runtime.feed_shapes]
            if all(f in buffers and f in names for f in flats):
                self._staged = [(f, buffers[f]) for f in flats]
                self._signature = live.signature
                self._runtime = runtime
        if self._staged is not None:
            self.inputs: dict[str, Any] = {names[f]: buf for f, buf in self._staged}
        else:  # no steady program (a plan that does not replay whole): the caller's copies, run() copies
            self.inputs = {name: _owned(value) for name, value in feeds.items()}

    @property
    def bound(self) -> bool:
        """True when the last warm-up left a steady program whose buffers ``inputs`` are."""
        return self._staged is not None

    def run(self) -> dict[str, Any]:
        """One step on ``inputs``: output name -> array. Without copies while the plan replays
        its steady program (the arrays are the plan's buffers, overwritten by its next step);
        otherwise the full path's owned copies."""
        staged = self._staged
        if staged is not None and self._signature is not None:
            cache = self._model.cache
            live = cache.acquire(self._signature)
            if live is not None:
                try:
                    runtime = live.runtime
                    results = (
                        runtime.execute_bound(staged) if runtime is not None and runtime is self._runtime else None
                    )
                finally:
                    cache.release(live)
                if results is not None:
                    self._model.last_live = live
                    on_device = self._model.outputs_on_device
                    return {
                        name: r if r.__class__ is np.ndarray else _as_output(r, on_device)
                        for name, r in zip(self._names, results)
                    }
        return self._model.run(self.inputs)
