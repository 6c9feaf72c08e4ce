"""DSP: compile a computation graph once into a flat plan, then run (and replay) it many times.

import dsp_core as dsp
model = dsp.compile("model.onnx")          # or an onnx.ModelProto, or a dsp Graph
outs = model.run({"x": x})                 # dict of every output
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from dsp_core import config
from dsp_core.backends.hookspecs import hookimpl
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import DSPError
from dsp_core.ir.builder import GraphBuilder
from dsp_core.ir.graph import Graph
from dsp_core.runtime.loader import as_source, compile_cached
from dsp_core.runtime.model import CompiledModel

try:
    __version__ = version("dsp-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"


def compile(  # noqa: A001  (the public name the API promises)
    model: Any,
    mode: str | GraphExecutionMode | None = None,
    *,
    strict: bool | None = None,
    force_recompile: bool | None = None,
    outputs_on_device: bool = False,
    base_dir: str | os.PathLike[str] | None = None,
    placement: Any = None,
) -> CompiledModel:
    """Compile a model (path, bytes, onnx.ModelProto or dsp Graph) for ``mode``.

    ``mode`` is a GraphExecutionMode or its name in any case ("slot_by_slot", "AUTO");
    None reads DSP_MODE (default AUTO). ``strict`` makes the auction fail rather than
    fall back to the reference backend or remap a GPU mode to the CPU; None reads
    DSP_STRICT (default off). A bad value of either is a ConfigError naming it.
    ONNX models go through the disk cache (DSP_DISK_CACHE, DSP_CACHE_DIR);
    ``force_recompile`` (or DSP_FORCE_RECOMPILE=1) ignores what it holds.
    ``outputs_on_device=True`` returns a GPU backend's outputs as device (CuPy) arrays
    instead of numpy (``model.outputs_on_device`` can be changed later).
    ``base_dir`` is the directory a model given as bytes or a proto reads its external
    data from (a path's own directory is used for a path; bytes have none).
    ``placement`` spreads the plan over devices (docs/devices.md): "single_device",
    "memory_fit", "pipeline_parallel", or a map {name_pattern: device}; None reads
    DSP_PLACEMENT when it is set, else one device without a placement pass.
    """
    parsed, strict, placement = config.compile_options(mode, strict, placement)
    if isinstance(model, Graph):
        from dsp_core.ir.typecheck import check_types  # onnx's schemas: a warm start from the cache needs none

        model.validate()
        check_types(model)
        compiled = CompiledModel(model, parsed, strict=strict, placement=placement)
    else:
        force = config.get("force_recompile", force_recompile)
        compiled = compile_cached(
            as_source(model),
            parsed,
            strict,
            __version__,
            force_recompile=force,
            base_dir=base_dir,
            placement=placement,
        )
    compiled.outputs_on_device = outputs_on_device
    return compiled


__all__ = [
    "CompiledModel",
    "DSPError",
    "Graph",
    "GraphBuilder",
    "GraphExecutionMode",
    "__version__",
    "compile",
    "hookimpl",
]
