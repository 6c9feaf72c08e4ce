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

import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dsp_core.errors import InputError
from dsp_core.runtime.model import _as_output  # model imports this module only inside bind()
from dsp_core.runtime.plan_runtime import _owned

if TYPE_CHECKING:
    from dsp_core.runtime.model import CompiledModel
    from dsp_core.runtime.plan_runtime import PlanRuntime


class Binding:
    """A shape signature's staging buffers as inputs, its replay buffers as outputs.

    ``inputs``: name -> the array to write the next step's value into (in place:
    ``binding.inputs["x"][...] = new``; a numpy array, or a device array where the plan
    stages that input on its device). ``bound``: whether ``run`` replays without copies now.
    A bound binding pins its plan in the plan cache (it is not evicted while the binding
    lives); ``close()`` (or leaving a ``with`` block, or dropping the binding) unpins it.
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
        for _ in range(settle):  # freeze, warm up, capture: until the plan replays its steady program
            model.run(feeds)
            live = model.last_live
            if live is not None and live.runtime is not None and live.runtime._steady is not None:
                break
        self._step: Callable[[], dict[str, Any] | None] | None = None
        self._pin: weakref.finalize | None = None
        self._runtime: PlanRuntime | None = None
        self._buffers: list[tuple[int, Any]] = []
        names = {spec.flat: spec.name for spec in model._feeds}
        live = model.last_live
        runtime = live.runtime if live is not None else None
        if runtime is not None and runtime._steady is not None:
            buffers = runtime.staging.buffers
            flats = [flat for flat, _, _ in runtime.feed_shapes]
            if all(f in buffers and f in names for f in flats):
                self._buffers = [(f, buffers[f]) for f in flats]
                self._runtime = runtime
        if self._runtime is not None and live is not None:
            self.inputs: dict[str, Any] = {names[f]: buf for f, buf in self._buffers}
            pinned = model.cache.acquire(live.signature)
            if pinned is live:  # held until close(): the plan stays in the cache, its buffers alive
                self._pin = weakref.finalize(self, model.cache.release, live)
                self._refresh()
            elif pinned is not None:
                model.cache.release(pinned)
        else:  # no steady program (a plan that does not replay whole): the caller's copies, run() copies
            self.inputs = {name: _owned(value) for name, value in feeds.items()}

    def _refresh(self) -> None:
        """Take the runtime's current steady program as this binding's ``run`` (none: the full path)."""
        runtime = self._runtime
        made = None
        if runtime is not None and self._pin is not None:
            full = _full_path(weakref.ref(self))  # no strong reference: dropping the binding unpins
            made = runtime.bound_step(self._names, full)
            if made is not None and any(b.__class__ is not np.ndarray for b in made[1]):
                made = runtime.bound_step(self._names, full, _handed_over(self._model))
        if made is not None and runtime is not None:
            buffers = runtime.staging.buffers
            if any(buffers.get(f) is not buf for f, buf in self._buffers):
                made = None  # the staging buffers were replaced: the caller's arrays are not the plan's
        if made is None:
            self._step = None
            self.__dict__.pop("run", None)  # the class's run: the full path
            return
        self._step = made[0]
        # The instance's ``run`` is the step itself: one call, no method frame in between.
        self.__dict__["run"] = made[0]

    @property
    def bound(self) -> bool:
        """True while ``run`` replays the plan's steady program on ``inputs`` without copies."""
        if self._step is None and self._pin is not None and self._pin.alive:
            self._refresh()
        return self._step is not None

    def run(self) -> dict[str, Any]:
        """One step on ``inputs``: output name -> array. Without copies while the plan replays
        its steady program (the arrays are the plan's buffers, overwritten by its next step);
        otherwise the full path's owned copies.

        While bound, ``binding.run`` is the plan's bound step itself (``PlanRuntime.bound_step``),
        which falls back to this full path when the plan left its steady program."""
        if self._pin is not None and self._pin.alive:
            self._refresh()  # a steady program again (diagnostics turned off since): bound from this step
            step = self.__dict__.get("run")
            if step is not None:
                result: dict[str, Any] = step()
                return result
        return self._full_run()

    def _full_run(self) -> dict[str, Any]:
        out = self._model.run(self.inputs)
        if self._pin is not None and self._pin.alive:
            self._refresh()  # a steady program again (recaptured, a constant restored) on the same buffers
        return out

    def close(self) -> None:
        """Unpin the plan (it may be evicted again); ``run`` then takes the full path, with copies."""
        self._step = None
        self.__dict__.pop("run", None)
        if self._pin is not None:
            self._pin()

    def __enter__(self) -> Binding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handed_over(model: CompiledModel) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A bound step's outputs as ``run`` returns them: device arrays as numpy unless the model
    keeps outputs on the device (``outputs_on_device``)."""

    def convert(results: dict[str, Any]) -> dict[str, Any]:
        on_device = model.outputs_on_device
        return {k: r if r.__class__ is np.ndarray else _as_output(r, on_device) for k, r in results.items()}

    return convert


def _full_path(ref: weakref.ref[Binding]) -> Callable[[], dict[str, Any]]:
    """What a bound step runs when its program is not current: the binding's full path."""

    def full() -> dict[str, Any]:
        binding = ref()
        if binding is None:  # a step kept (``f = binding.run``) past its binding's collection
            raise InputError("this binding was collected: its step can no longer fall back to the full path")
        return binding._full_run()

    return full
