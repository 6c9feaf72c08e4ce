"""A segment as one compiled OpenVINO model; after freezing, its tensors are DSP's buffers."""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
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

log = logging.getLogger("dsp.openvino")

# A blob OpenVINO loads from its CACHE_DIR is checked before use: a probe inference (fixed
# pseudo-random inputs of the model's shapes) must give the bits the fresh compile gave, kept
# beside the blob. OpenVINO 2026.4's import of the Llama fixture's decode-step model computed
# other outputs than its fresh compile (max abs diff 11.8, at times uninitialised memory), in
# every process after the first: a warm cache served wrong results. A model whose blob fails
# the probe is compiled afresh, and never cached again (its folder holds only a marker).
_PROBE = "dsp-probe.digest"
_NO_CACHE = "dsp-no-cache"


def _probe(compiled: Any) -> str:
    """A digest of ``compiled``'s outputs on fixed inputs of its (static) shapes."""
    rng = np.random.default_rng(0)
    inputs = {}
    for port in compiled.inputs:
        shape = list(port.get_partial_shape().to_shape())
        dtype = np.dtype(port.get_element_type().to_dtype())
        if dtype.kind == "f":
            inputs[port] = rng.standard_normal(shape).astype(dtype)
        else:  # indices, positions, masks: small values every op takes
            inputs[port] = rng.integers(0, 2, shape).astype(dtype)
    results = compiled.create_infer_request().infer(inputs)
    digest = hashlib.blake2b(digest_size=16)
    for port in compiled.outputs:
        digest.update(np.ascontiguousarray(results[port]).tobytes())
    return digest.hexdigest()


def compile_checked(ov_model: Any, model: bytes, threads: int | None = None) -> Any:
    """``ov_model`` compiled for the CPU with DSP's settings; through OpenVINO's model cache, in a
    folder of its own (named by the model's bytes and the settings), when a probe says the cached
    blob computes what a fresh compile computes. A model with a dynamic shape cannot be probed,
    so it is not cached. ``threads``: as ``compile_config`` takes them."""
    settings = compile_config(threads)
    root = settings.pop("CACHE_DIR", None)
    if root is None or any(p.get_partial_shape().is_dynamic for p in ov_model.inputs):
        return core().compile_model(ov_model, "CPU", settings)
    tag = f"{ov.__version__}|{sorted(settings.items())}".encode()
    folder = Path(root) / hashlib.blake2b(model + tag, digest_size=16).hexdigest()
    if (folder / _NO_CACHE).exists():
        return core().compile_model(ov_model, "CPU", settings)
    compiled = core().compile_model(ov_model, "CPU", {**settings, "CACHE_DIR": str(folder)})
    kept = folder / _PROBE
    try:
        digest = _probe(compiled)
    except Exception as exc:  # noqa: BLE001  (a probe the model does not take: no cache for it)
        why = f"its probe failed ({type(exc).__name__}: {exc})"
    else:
        if not compiled.get_property("LOADED_FROM_CACHE"):
            kept.write_text(digest)  # the fresh compile's outputs: what a blob must reproduce
            return compiled
        if kept.is_file() and kept.read_text() == digest:
            return compiled
        why = "OpenVINO's cached blob computed other outputs than a fresh compile"
    fresh = core().compile_model(ov_model, "CPU", settings)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _NO_CACHE).write_text(why + "\n")
    log.warning("DSP openvino: %s; this model is compiled afresh from now on (%s)", why, folder)
    return fresh


class Compiled:
    """A compiled model with one infer request, and where each of DSP's inputs and outputs sits in it."""

    def __init__(self, compiled: Any, inputs: list[str], outputs: list[str]) -> None:
        self.model = compiled
        self.request = compiled.create_infer_request()
        self.in_ports = [compiled.input(n) for n in inputs]
        self.out_ports = [compiled.output(n) for n in outputs]


class OpenVinoSegment(WholeSegment):
    """``WholeSegment`` on OpenVINO: ``run`` infers with shared inputs, a replay infers on set tensors.

    Merged products are written as their parts (``split_merged``): OpenVINO fuses a model's
    products its own way, and DSP's one wide product with a Slice per part cost it 4-6% on
    MiniLM-L3 at 2 threads (batch 1: 9.3 against 8.9 ms; batch 8: 66.0 against 62.2 ms).
    """

    split_merged = True

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
        return Compiled(compile_checked(ov_model, model, self.threads), self._in_names, self._out_names)

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
