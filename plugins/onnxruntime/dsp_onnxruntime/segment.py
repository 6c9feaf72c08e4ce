"""A segment as one ONNX Runtime InferenceSession; after freezing, I/O bound once with IOBinding."""

from __future__ import annotations

import functools
import hashlib
import platform
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

from dsp_core.backends.base import Backend
from dsp_core.backends.whole import ShapeKey, WholeSegment, cpu_threads, runtime_cache_dir
from dsp_core.plan.plan import Plan, Segment
from dsp_core.plan.subgraph import name_of


def session_options(threads: int, alone: bool = False) -> ort.SessionOptions:
    """DSP's session options: threads from DSP_CPU_THREADS, every graph optimisation, sequential.

    ``alone``: the session is all a frozen step runs (every other slot of the plan sealed).
    """
    opts = ort.SessionOptions()
    if threads > 0:
        opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors only: DSP reports what matters
    if threads != 1 and not alone:
        # Pool threads that spin keep the cores busy while the next segment (on another
        # runtime, or the reference) runs: with several threads they starve it (GPT-2 124M
        # decode at 2 threads: 8 -> 29 tokens/s without spinning; spinning only within a
        # call, session.force_spinning_stop, measured 6.8 against 12.3 tokens/s without). A
        # session that is the whole step keeps ORT's default spinning: the CNN fixture at 2
        # threads, 46 -> 31 us a call.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def cached_session(model: bytes, alone: bool = False) -> ort.InferenceSession:
    """A session over ``model``; its optimized form is kept under DSP's cache and loaded next time.

    The optimized file depends on the model, ONNX Runtime's version, the thread count
    and the machine (level-ALL optimisations choose CPU-specific layouts), so all four
    name it. A later process loads it with optimisations off: they are already applied.
    """
    threads = cpu_threads()
    folder = runtime_cache_dir("onnxruntime")
    providers = ["CPUExecutionProvider"]
    if folder is None:
        return ort.InferenceSession(model, session_options(threads, alone), providers=providers)
    tag = f"{ort.__version__}|{threads}|{platform.machine()}".encode()
    path = folder / f"{hashlib.blake2b(model + tag, digest_size=16).hexdigest()}.onnx"
    if path.is_file():
        opts = session_options(threads, alone)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            return ort.InferenceSession(str(path), opts, providers=providers)
        except Exception:  # noqa: BLE001  (a damaged cache file: rebuilt below)
            path.unlink(missing_ok=True)
    opts = session_options(threads, alone)
    temp = path.with_suffix(".tmp")
    opts.optimized_model_filepath = str(temp)
    session = ort.InferenceSession(model, opts, providers=providers)
    try:
        temp.replace(path)  # atomic: a reader never sees half a file
    except OSError:
        pass
    return session


class OnnxRuntimeSegment(WholeSegment):
    """``WholeSegment`` on ONNX Runtime: ``run`` is ``session.run``, a replay ``run_with_iobinding``.

    Its ScatterElements skips the copy of its input when the output is the input's memory, so a
    replay binds each KV store's updated buffer onto the buffer (``in_place_stores``).
    """

    in_place_stores = True

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, plan, segment)
        self._in_names = [name_of(f) for f in self.io.inputs]
        self._out_names = [name_of(f) for f in self.io.outputs]

    def _build(self, model: bytes, key: ShapeKey) -> Any:
        return cached_session(model, self.alone)

    def _infer(self, compiled: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return list(compiled.run(self._out_names, dict(zip(self._in_names, inputs))))

    def _bind(self, compiled: Any, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> Callable[[], Any]:
        binding = compiled.io_binding()
        for name, a in zip(self._in_names, inputs):
            binding.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        for name, b in zip(self._out_names, outputs):
            binding.bind_output(name, "cpu", 0, b.dtype, list(b.shape), b.ctypes.data)
        # The C++ call itself, as a partial: no Python frame, no wrapper per replay.
        return functools.partial(compiled._sess.run_with_iobinding, binding._iobinding, None)
