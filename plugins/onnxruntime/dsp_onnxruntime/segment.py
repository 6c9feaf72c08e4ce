"""A segment as one ONNX Runtime InferenceSession; after freezing, I/O bound once with IOBinding."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

from dsp_core import config
from dsp_core.backends.auction import slot_view
from dsp_core.backends.base import Backend, CaptureFailed
from dsp_core.backends.whole import ShapeKey, WholeSegment, cpu_threads, runtime_cache_dir
from dsp_core.ops.llm import is_kv_store
from dsp_core.plan.merge import is_merged
from dsp_core.plan.plan import Plan, Segment
from dsp_core.plan.subgraph import TENSOR_SCATTER_OPSET, name_of


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


def cuda_providers(device: int) -> list[Any]:
    """The providers of a session on CUDA device ``device``: CUDA first, the CPU for nodes it lacks.

    use_tf32 off: DSP's contract keeps float32 products in float32 (ONNX Runtime allows TF32 by
    default on GPUs that have it).
    """
    return [("CUDAExecutionProvider", {"device_id": str(device), "use_tf32": "0"}), "CPUExecutionProvider"]


def cached_session(
    model: bytes, alone: bool = False, device: int | None = None, threads: int | None = None
) -> ort.InferenceSession:
    """A session over ``model``; its optimized form is kept under DSP's cache and loaded next time.

    The optimized file depends on the model, ONNX Runtime's version, the thread count
    and the machine (level-ALL optimisations choose CPU-specific layouts), so all four
    name it. A later process loads it with optimisations off: they are already applied.

    ``device``: a session on that CUDA device (onnxruntime-gpu). It is not kept on disk: an
    optimized model of the CUDA provider holds nodes fused for that provider and GPU.

    ``threads``: intra-op threads (the segment's own count); None: DSP_CPU_THREADS.
    """
    threads = cpu_threads() if threads is None else threads
    if device is not None:
        opts = session_options(threads, alone)
        # Same inputs, same outputs (the contract's ``deterministic``): without it, a unit's outputs
        # are checked every step, and the plan never settles into its bound steady program.
        opts.use_deterministic_compute = True
        return ort.InferenceSession(model, opts, providers=cuda_providers(device))
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


def cuda_probe() -> str | None:
    """None when a session on the current CUDA device runs its nodes on the CUDA provider; else why not.

    onnxruntime-gpu lists the provider whenever its library is installed; whether it loads (the
    CUDA, cuBLAS and cuDNN libraries it links) shows only when a session asks for it, and a session
    that cannot have it silently runs on the CPU. ``preload_dlls`` first loads those libraries from
    the NVIDIA wheels (nvidia-cublas, nvidia-cudnn, ...) where they are installed.
    """
    import cupy
    from onnx import TensorProto, helper

    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload(cuda=True, cudnn=True, msvc=False)
        except Exception:  # noqa: BLE001  (not there: the system's libraries may still be found)
            pass
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "dsp_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    try:
        session = ort.InferenceSession(
            model.SerializeToString(),
            session_options(1),
            providers=cuda_providers(int(cupy.cuda.Device().id)),
        )
    except Exception as exc:  # noqa: BLE001  (any failure to load the provider is the answer)
        return f"onnxruntime {ort.__version__} cannot start its CUDA provider: {type(exc).__name__}: {exc}"
    if session.get_providers()[0] != "CUDAExecutionProvider":
        return (
            f"onnxruntime {ort.__version__} lists its CUDA provider but could not load it (missing CUDA or cuDNN "
            "libraries for this build: pip install nvidia-cudnn-cu13 nvidia-cublas, or the build matching this CUDA)"
        )
    return None


# The part of a KV buffer up to which the attention reads only the positions written so far, at one
# thread and at more (OnnxRuntimeSegment._attention_window)
WINDOW_BELOW_ONE_THREAD = 0.5
WINDOW_BELOW = 1 / 3
# How long a spinning session's pool threads keep their cores after a call returns (ONNX
# Runtime's workers spin about a million pauses before they sleep). Measured at 2 threads on a
# 2-core AMD EPYC: OpenVINO's MiniLM-L3 step 13.7 ms right after an ONNX Runtime call, 12.1 ms
# 30 ms after, 8.2-8.4 ms from 50 ms on (its own time alone, 9.0 ms).
SPIN_SETTLE_S = 0.06


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
        return cached_session(model, self.alone, threads=self.threads)

    @property
    def settle_s(self) -> float:
        # Only a session that is the whole step spins (session_options): with several threads
        # its pool keeps the cores a while after each call.
        threads = self.threads or os.cpu_count() or 1
        return SPIN_SETTLE_S if self.alone and threads > 1 else 0.0

    def _tensor_scatter(self) -> bool:
        # ONNX Runtime's TensorScatter writes in place when its output is bound onto the cache (3 µs
        # for a 467 KB GPT-2 124M buffer), where its ScatterElements copies the buffer (24 µs): where
        # the CPU provider has kernels at opset 24 for every op the segment is written with.
        from dsp_onnxruntime.plugin import kernels_at

        if not self.stores:
            return False
        ops = {"TensorScatter", "Cast", "Reshape", "Gather", "Less", "Add", "Where", "Expand"}
        for s in self._slots:
            slot = self.plan.slots[s]
            if is_merged(slot):
                ops |= {str(slot.attrs.get("form", "MatMul")), "Concat", "Slice"}
            elif slot.domain in ("", "ai.onnx") and not is_kv_store(slot):
                ops.add(slot.op)
        return kernels_at(ops, TENSOR_SCATTER_OPSET)

    def _attention_window(self) -> float:
        # Its tensors inside a session take their shapes as it runs: a decode step's attention reads
        # the positions written so far, not the whole KV buffer, while they are fewer than a part of
        # it. Its Slice copies them, and with more threads the copy costs more than the product
        # saves sooner (subgraph._attention_nodes): up to half of the buffer at one thread, a third
        # at more (GPT-2 124M, 2 threads: 67.9 tok/s always windowed, 77.5 never, at 280 positions).
        if not config.get("runtime_kv_window"):
            return 0.0
        return WINDOW_BELOW_ONE_THREAD if self.threads == 1 else WINDOW_BELOW

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


class OnnxRuntimeCudaSegment(OnnxRuntimeSegment):
    """``OnnxRuntimeSegment`` on the CUDA provider: the session reads and writes CuPy device arrays.

    - ``run`` (eager) feeds host copies of the inputs (``session.run`` moves them) and keeps each
      output on the device, except those a CPU segment reads (``host_outputs``), which stay on the host;
    - ``capture`` binds device buffers once: an input that is a device array in place, a host one
      through a device buffer of its own that each replay fills; every output into a device buffer,
      and a host output is also copied to a host buffer after the call;
    - a replay waits for the device (the inputs other segments or the staging copies wrote on their
      streams are complete), makes the one ``run_with_iobinding`` call (which returns once the
      provider's stream is done), then copies the host outputs.
    """

    in_place_stores = False  # the backend declines KV stores

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, plan, segment)
        import cupy

        self._cp = cupy
        self._device = int(cupy.cuda.Device().id)
        mine = set(segment.slots)
        readers = [s for s in range(len(plan.slots)) if s not in mine]
        self.host_outputs: frozenset[int] = frozenset(
            o
            for o in self._outputs
            if any(
                plan.flat(r) == o and backend.supports(slot_view(plan, s)) is not None
                for s in readers
                for r in plan.slots[s].inputs
                if r is not None
            )
        )
        self._host_buffers: dict[int, np.ndarray] = {}

    def _build(self, model: bytes, key: ShapeKey) -> Any:
        return cached_session(model, self.alone, device=self._device)

    def _eager_input(self, x: Any) -> Any:
        if isinstance(x, self._cp.ndarray):
            return self._cp.asnumpy(x)
        return super()._eager_input(x)

    def _eager_output(self, flat: int, out: Any) -> Any:
        return out if flat in self.host_outputs else self._cp.asarray(out)

    def _prepare(self, values: list[Any]) -> None:
        current = self._warm_outputs
        cp = self._cp
        if current is None or any(not isinstance(a, np.ndarray | cp.ndarray) for a in current):
            raise CaptureFailed(f"{self.backend.name}: an output of segment {self.segment.index} is not an array")
        if len(self._buffers) != len(current) or any(
            b.shape != a.shape or b.dtype != a.dtype for b, a in zip(self._buffers, current)
        ):
            self._buffers = [cp.empty(a.shape, a.dtype) for a in current]
            self._host_buffers = {
                k: np.empty(a.shape, a.dtype)
                for k, (o, a) in enumerate(zip(self._outputs, current))
                if o in self.host_outputs
            }
        self._warm_outputs = None

    def _capture(self, values: list[Any]) -> None:
        if not self._slots:
            super()._capture(values)
            return
        cp = self._cp
        inputs = [values[i] for i in self._inputs]
        staged: list[tuple[np.ndarray, Any]] = []
        device_inputs = []
        for flat, a in zip(self._inputs, inputs):
            if isinstance(a, cp.ndarray) and a.flags.c_contiguous:
                device_inputs.append(a)
            elif isinstance(a, np.ndarray) and a.flags.c_contiguous:
                d = cp.empty(a.shape, a.dtype)
                staged.append((a, d))
                device_inputs.append(d)
            else:
                raise CaptureFailed(
                    f"{self.backend.name}: input v{flat} of segment {self.segment.index} is not a C-contiguous "
                    "array, so it cannot be bound in place"
                )
        compiled = self.compiled_for(values)
        binding = compiled.io_binding()
        for name, d in zip(self._in_names, device_inputs):
            binding.bind_input(name, "cuda", self._device, d.dtype, list(d.shape), d.data.ptr)
        buffers: list[Any] = list(self._buffers)  # CuPy arrays
        for name, d in zip(self._out_names, buffers):
            binding.bind_output(name, "cuda", self._device, d.dtype, list(d.shape), d.data.ptr)
        call = functools.partial(compiled._sess.run_with_iobinding, binding._iobinding, None)
        downloads = [(buffers[k], h) for k, h in self._host_buffers.items()]
        wait = cp.cuda.runtime.deviceSynchronize

        def step() -> None:
            for host, dev in staged:
                dev.set(host)
            wait()
            call()
            for dev, host in downloads:
                dev.get(out=host)

        self._bound = step
        self._bound_inputs = tuple(inputs)
        self._bound_outputs = tuple(self._host_buffers.get(k, b) for k, b in enumerate(self._buffers))
