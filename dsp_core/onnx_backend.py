"""DSP as an ``onnx.backend.base.Backend``, so ONNX's own backend test suite runs through it.

from dsp_core import onnx_backend
rep = onnx_backend.prepare(model_proto)
outputs = rep.run([x, y])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import DSPError, UnsupportedOpError
from dsp_core.ir.onnx_import import import_model
from dsp_core.runtime.model import CompiledModel


class DSPBackendRep(BackendRep):
    """A prepared model: ``run`` takes inputs in graph order (or a dict) and returns a list."""

    def __init__(self, model: CompiledModel) -> None:
        self.model = model

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Run on positional inputs (graph input order) or a name -> array dict."""
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self.model.input_names, inputs))
        outs = self.model.run(feeds)
        return tuple(outs[name] for name in self.model.output_names)


class DSPBackend(Backend):
    """ONNX backend API over ``dsp_core.compile`` (mode AUTO unless ``mode=`` is given)."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> DSPBackendRep:
        """Import and compile ``model``."""
        super().prepare(model, device, **kwargs)
        mode = GraphExecutionMode.parse(kwargs.get("mode", "auto"))
        return DSPBackendRep(CompiledModel(import_model(model), mode))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        """Prepare and run once."""
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Any,
        device: str = "CPU",
        outputs_info: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """Run a single node (builds a one-node model around it)."""
        raise DSPError("run_node is not supported; use prepare() on a model")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """DSP's reference runs on the CPU; GPU backends are chosen by AUTO inside."""
        return device in ("CPU", "CUDA")


prepare = DSPBackend.prepare
run_model = DSPBackend.run_model
run_node = DSPBackend.run_node
supports_device = DSPBackend.supports_device

__all__ = ["DSPBackend", "DSPBackendRep", "UnsupportedOpError", "prepare", "run_model", "run_node", "supports_device"]
