"""A segment as one compiled OpenVINO model; after freezing, its tensors are DSP's buffers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import openvino as ov
from openvino import _pyopenvino

from dsp_core.backends.base import Backend
from dsp_core.backends.whole import ShapeKey, WholeSegment
from dsp_core.errors import BackendError
from dsp_core.plan.plan import Plan, Segment
from dsp_core.plan.subgraph import name_of
from dsp_openvino.plugin import compile_config, core

# The infer call of the C++ binding itself: no Python wrapper (input conversion, result
# dict) on a replay, whose tensors are already set.
_RAW_INFER = _pyopenvino.InferRequest.infer
_NO_INPUTS: dict[Any, Any] = {}


class Compiled:
    """A compiled model with one infer request, and where each of DSP's inputs and outputs sits in it."""

    def __init__(self, compiled: Any, inputs: list[str], outputs: list[str]) -> None:
        self.model = compiled
        self.request = compiled.create_infer_request()
        self.in_ports = [compiled.input(n) for n in inputs]
        self.out_ports = [compiled.output(n) for n in outputs]


class OpenVinoSegment(WholeSegment):
    """``WholeSegment`` on OpenVINO: ``run`` infers with shared inputs, a replay infers on set tensors."""

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, plan, segment)
        self._in_names = [name_of(f) for f in self.io.inputs]
        self._out_names = [name_of(f) for f in self.io.outputs]

    def _build(self, model: bytes, key: ShapeKey) -> Any:
        ov_model = core().read_model(model, b"")
        supported = core().query_model(ov_model, "CPU")
        missing = [
            f"{op.get_type_name()} {op.get_friendly_name()!r}"
            for op in ov_model.get_ops()
            if op.get_friendly_name() not in supported and op.get_type_name() not in ("Parameter", "Result", "Constant")
        ]
        if missing:
            raise BackendError(f"OpenVINO's CPU plugin does not take {', '.join(missing[:4])} (Core.query_model)")
        return Compiled(core().compile_model(ov_model, "CPU", compile_config()), self._in_names, self._out_names)

    def _share(self, compiled: Any) -> Any:
        # the compiled model is shared; its infer request (bound tensors) is this segment's own
        return Compiled(compiled.model, self._in_names, self._out_names)

    def _infer(self, compiled: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        results = compiled.request.infer(dict(zip(compiled.in_ports, inputs)), share_inputs=True)
        return [np.array(results[p]) for p in compiled.out_ports]

    def _bind(self, compiled: Any, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> Callable[[], Any]:
        request = compiled.request
        for port, a in zip(compiled.in_ports, inputs):
            request.set_tensor(port, ov.Tensor(a, shared_memory=True))
        for port, b in zip(compiled.out_ports, outputs):
            request.set_tensor(port, ov.Tensor(b, shared_memory=True))
        return functools.partial(_RAW_INFER, request, _NO_INPUTS, True, False)  # no Python frame per replay
