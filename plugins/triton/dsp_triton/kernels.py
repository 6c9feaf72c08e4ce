"""A fusion group at run time: its reference steps, its generated Triton kernel, the check between them.

``FusedGroup`` is the one step that replaces a group's slots in a TRITON segment. The first
time it meets a layout of its inputs (outside any capture) it:

1. runs the group's reference kernels (the same CuPy kernels CUDA_GRAPHS runs), which gives
   every intermediate value's shape and dtype and the reference outputs;
2. generates the group's Triton source for those shapes (``codegen.generate``), compiles it
   through DSP's checked kernel cache, loads the module, and tunes a small set of block
   configs (the winner cached on disk with the kernel);
3. launches it and checks its outputs against the reference outputs within the contract's
   tolerance. A mismatch demotes the group, loudly: it runs its reference kernels from then
   on (in the same captured graph), and the reason is kept for ``dsp plan explain``.

Later calls launch the compiled kernel with raw pointers on the segment's stream, so inside
a capture nothing is compiled, loaded or tuned. A layout first seen *during* a capture
fails that capture (CaptureFailed) rather than compiling inside it.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsp_core.backends.base import CaptureFailed
from dsp_triton import codegen
from dsp_triton.cache import TuneCache, cache_root, scoped, source_key, write_checked

log = logging.getLogger("dsp.triton")

Step = tuple[Any, tuple[int, ...], Any, tuple[int, ...]]
TUNE_RUNS = 5
# Loaded kernels by (source, warps), alive as long as the process: a captured graph holds
# their functions, and a module freed while a graph can still launch it breaks the graph.
_BINARIES: dict[tuple[str, int], Any] = {}


@dataclass
class GroupReport:
    """What became of one group: fused into a Triton kernel, or why it runs its reference kernels."""

    index: int
    template: str
    slots: tuple[int, ...]
    status: str = "pending"  # "triton", "reference", "demoted", "pending"
    reason: str = ""
    kernel: str = ""
    config: dict[str, int] = field(default_factory=dict)
    compile_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.index,
            "template": self.template,
            "slots": list(self.slots),
            "status": self.status,
            "reason": self.reason,
            "kernel": self.kernel,
            "config": dict(self.config),
            "compile_ms": round(self.compile_ms, 2),
        }


class _Compiled:
    """A loaded kernel and its launch geometry."""

    def __init__(self, binary: Any, kernel: codegen.Kernel, shapes: dict[int, tuple[tuple[int, ...], Any]]) -> None:
        self.binary = binary  # triton CompiledKernel, handles initialised (module loaded)
        self.kernel = kernel
        self.shapes = shapes  # output value -> (shape, dtype)

    def empty_outputs(self, cp: Any) -> dict[int, Any]:
        return {
            v: cp.empty(self.shapes[v][0], dtype=self.shapes[v][1]) for v in self.kernel.args[self.kernel.n_inputs :]
        }

    def launch(self, ptrs: Sequence[int], stream: int) -> None:
        self.binary[self.kernel.grid](*ptrs, stream=stream)


class FusedGroup:
    """The step that runs one fusion group."""

    def __init__(
        self,
        report: GroupReport,
        steps: list[Step],
        in_flats: tuple[int, ...],
        out_flats: tuple[int, ...],
        nodes: list[codegen.NodeSpec],
        constants: Callable[[int, Any], np.ndarray | None],
        tolerance: float,
        cupy: Any,
        capturing: Callable[[], bool],
    ) -> None:
        self.report = report
        self.steps = steps
        self.in_flats = in_flats
        self.out_flats = out_flats
        self.nodes = nodes
        self.constants = constants
        self.tolerance = tolerance
        self.cp = cupy
        self.capturing = capturing
        self.compiled: dict[tuple[Any, ...], _Compiled] = {}
        self.single = len(out_flats) == 1

    # -- the reference path ----------------------------------------------------------------
    def reference(self, inputs: Sequence[Any], keep: bool = False) -> tuple[tuple[Any, ...], dict[int, Any]]:
        """The group's slots on their reference kernels: its outputs (and, with ``keep``, every value)."""
        local: dict[int, Any] = dict(zip(self.in_flats, inputs))
        for kernel, ins, outs, releases in self.steps:
            got = kernel(*[local.get(i) for i in ins])
            if isinstance(outs, int):
                local[outs] = got
            else:
                for o, x in zip(outs, got):
                    local[o] = x
            if not keep:
                for r in releases:
                    if r not in self.out_flats:
                        local.pop(r, None)
        return tuple(local.get(o) for o in self.out_flats), local

    def __call__(self, *inputs: Any) -> Any:
        if self.report.status in ("reference", "demoted"):
            outs, _ = self.reference(inputs)
        else:
            outs = self._fused(inputs)
        return outs[0] if self.single else outs

    # -- the fused path ----------------------------------------------------------------------
    def _signature(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        sig: list[Any] = []
        for x in inputs:
            if hasattr(x, "data") and hasattr(x, "strides"):
                sig.append(
                    (
                        x.shape,
                        x.strides,
                        x.dtype.str,
                        isinstance(x, np.ndarray),
                        int(x.data.ptr) % 16 == 0 if not isinstance(x, np.ndarray) else True,
                    )
                )
            else:
                sig.append((type(x).__name__, np.asarray(x).shape if x is not None else None))
        return tuple(sig)

    def _fused(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        key = self._signature(inputs)
        compiled = self.compiled.get(key)
        if compiled is None:
            if self.capturing():
                raise CaptureFailed(
                    f"fusion group {self.report.index} met a new input layout during capture; "
                    "its kernel must be compiled before capture"
                )
            got = self._compile(inputs, key)
            if got is None:
                outs, _ = self.reference(inputs)
                return outs
            compiled = got
        return self._launch(compiled, inputs)

    def _launch(self, compiled: _Compiled, inputs: Sequence[Any]) -> tuple[Any, ...]:
        cp = self.cp
        kernel = compiled.kernel
        by_flat = dict(zip(self.in_flats, inputs))
        outs = compiled.empty_outputs(cp)
        ptrs = [int(by_flat[v].data.ptr) for v in kernel.args[: kernel.n_inputs]]
        ptrs += [int(outs[v].data.ptr) for v in kernel.args[kernel.n_inputs :]]
        compiled.launch(ptrs, cp.cuda.get_current_stream().ptr)
        return tuple(outs[o] for o in self.out_flats)

    def _spec(self, inputs: Sequence[Any]) -> tuple[codegen.GroupSpec, tuple[Any, ...], dict[int, Any]]:
        ref_outs, local = self.reference(inputs, keep=True)
        values: dict[int, codegen.TensorSpec] = {}
        for flat, x in local.items():
            if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
                continue
            strides = None
            if flat in self.in_flats and hasattr(x, "strides"):
                item = x.dtype.itemsize
                if any(s % item for s in x.strides):
                    raise codegen.Unsupported(f"input {flat} has strides {x.strides} not in whole elements")
                strides = tuple(int(s) // item for s in x.strides)
            values[flat] = codegen.TensorSpec(tuple(int(d) for d in x.shape), str(x.dtype), strides)
        device_inputs = [
            f for f, x in zip(self.in_flats, inputs) if x is not None and not isinstance(x, np.ndarray | np.generic)
        ]
        spec = codegen.GroupSpec(
            self.report.template,
            self.nodes,
            values,
            device_inputs,
            list(self.out_flats),
            lambda v: self.constants(v, local.get(v)),
        )
        return spec, ref_outs, local

    def _compile(self, inputs: Sequence[Any], key: tuple[Any, ...]) -> _Compiled | None:
        start = time.perf_counter()
        try:
            spec, ref_outs, local = self._spec(inputs)
            kernel = codegen.generate(spec)
        except codegen.Unsupported as exc:
            self._settle("reference", str(exc))
            return None
        shapes = {v: (spec.values[v].shape, np.dtype(spec.values[v].dtype)) for v in spec.outputs}
        for v in kernel.args[: kernel.n_inputs]:
            x = local[v]
            if isinstance(x, np.ndarray):
                self._settle("reference", f"input {v} is a host array")
                return None
        try:
            compiled = self._build(kernel, local, shapes)
            compiled = self._tune(spec, compiled, local, shapes)
        except Exception as exc:  # noqa: BLE001  (a compiler error: this group runs its reference kernels)
            self._settle("reference", f"Triton failed to compile it: {type(exc).__name__}: {str(exc)[:300]}")
            log.warning("DSP TRITON: group %d (%s): %s", self.report.index, self.report.template, self.report.reason)
            return None
        got = self._launch(compiled, inputs)
        bad = _mismatch(got, ref_outs, self.tolerance, self.cp)
        self.report.compile_ms += (time.perf_counter() - start) * 1000
        if bad is not None:
            self._settle("demoted", f"its kernel disagreed with the reference kernels: {bad}")
            message = (
                f"DSP TRITON: fusion group {self.report.index} ({self.report.template}, slots "
                f"{list(self.report.slots)}) demoted to its reference kernels: {bad}"
            )
            warnings.warn(message, stacklevel=2)
            log.warning(message)
            return None
        self.compiled[key] = compiled
        self.report.status = "triton"
        self.report.kernel = compiled.kernel.name
        self.report.config = {"block": compiled.kernel.block, "num_warps": compiled.kernel.num_warps}
        return compiled

    def _settle(self, status: str, reason: str) -> None:
        self.report.status = status
        self.report.reason = reason

    def _build(
        self, kernel: codegen.Kernel, local: dict[int, Any], shapes: dict[int, tuple[tuple[int, ...], Any]]
    ) -> _Compiled:
        memo = _BINARIES.get((kernel.source, kernel.num_warps))
        if memo is not None:
            return _Compiled(memo, kernel, shapes)
        import importlib.util

        import triton

        path = cache_root() / "src" / f"{source_key(kernel.source, '', triton.__version__)}.py"
        try:
            if not path.exists() or path.read_text() != kernel.source:
                write_checked(path, kernel.source.encode())
        except OSError:
            import tempfile

            path = _tmp_dir(tempfile) / path.name
            path.write_text(kernel.source)
        spec = importlib.util.spec_from_file_location(f"dsp_triton_gen_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, kernel.name)
        args = [_Arg(local[v]) for v in kernel.args[: kernel.n_inputs]]
        scratch = [self.cp.empty(shapes[v][0], dtype=shapes[v][1]) for v in kernel.args[kernel.n_inputs :]]
        args += [_Arg(x) for x in scratch]
        with scoped():
            binary = fn.warmup(*args, grid=kernel.grid, num_warps=kernel.num_warps)
        binary._init_handles()  # load the module now, never inside a capture
        _BINARIES[(kernel.source, kernel.num_warps)] = binary  # kept for the process: graphs launch it
        return _Compiled(binary, kernel, shapes)

    def _tune(
        self,
        spec: codegen.GroupSpec,
        first: _Compiled,
        local: dict[int, Any],
        shapes: dict[int, tuple[tuple[int, ...], Any]],
    ) -> _Compiled:
        """A small config set for pointwise kernels, timed; the winner cached by source and device."""
        if spec.template == "row_reduction":
            return first
        import triton

        numel = max(1, math.prod(spec.values[max(spec.outputs, key=lambda v: spec.values[v].numel)].shape))
        blocks = [b for b in (128, 256, 512, 1024, 2048) if b <= max(128, 1 << (numel - 1).bit_length())]
        if len(blocks) <= 1:
            return first
        device = _device_name(self.cp)
        key = source_key(first.kernel.source, device, triton.__version__)
        tunes = TuneCache()
        chosen = tunes.get(key)
        candidates: dict[int, _Compiled] = {first.kernel.block: first}
        if chosen is not None and isinstance(chosen.get("block"), int):
            block = int(chosen["block"])
            if block in candidates:
                return candidates[block]
            return self._build(codegen.generate(spec, block=block), local, shapes)
        times: dict[int, float] = {}
        for block in blocks:
            if block not in candidates:
                candidates[block] = self._build(codegen.generate(spec, block=block), local, shapes)
            times[block] = self._time(candidates[block], local)
        best = min(times, key=lambda b: times[b])
        tunes.put(key, {"block": best, "times_us": {str(b): round(t, 3) for b, t in times.items()}})
        return candidates[best]

    def _time(self, compiled: _Compiled, local: dict[int, Any]) -> float:
        cp = self.cp
        kernel = compiled.kernel
        ptrs = [int(local[v].data.ptr) for v in kernel.args[: kernel.n_inputs]]
        scratch = compiled.empty_outputs(cp)
        ptrs += [int(x.data.ptr) for x in scratch.values()]
        stream = cp.cuda.get_current_stream()
        compiled.launch(ptrs, stream.ptr)
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record(stream)
        for _ in range(TUNE_RUNS):
            compiled.launch(ptrs, stream.ptr)
        end.record(stream)
        end.synchronize()
        return float(cp.cuda.get_elapsed_time(begin, end)) * 1000 / TUNE_RUNS


class _Arg:
    """What Triton's specialisation needs of an argument: a pointer and a dtype."""

    def __init__(self, arr: Any) -> None:
        import torch

        self._ptr = int(arr.data.ptr)
        self.dtype = getattr(torch, _TORCH.get(str(arr.dtype), str(arr.dtype)))

    def data_ptr(self) -> int:
        return self._ptr


_TORCH = {"bool": "bool", "float16": "float16", "float32": "float32", "float64": "float64", "bfloat16": "bfloat16"}


def _tmp_dir(tempfile: Any) -> Any:
    from pathlib import Path

    d = Path(tempfile.gettempdir()) / "dsp-triton-src"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _device_name(cp: Any) -> str:
    dev = cp.cuda.Device()
    cc = dev.compute_capability
    try:
        name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        name = "cuda"
    return f"{name}:sm{cc}"


def _mismatch(got: Sequence[Any], want: Sequence[Any], tolerance: float, cp: Any) -> str | None:
    """None when every output agrees within ``tolerance`` (relative to the reference's scale), else why not."""
    for k, (a, b) in enumerate(zip(got, want)):
        if b is None:
            continue
        x, y = cp.asnumpy(a), cp.asnumpy(b)
        if x.shape != y.shape:
            return f"output {k} has shape {x.shape}, the reference {y.shape}"
        if x.dtype.kind in "fc":
            xf, yf = x.astype(np.float64), y.astype(np.float64)
            if not np.array_equal(np.isnan(xf), np.isnan(yf)):
                return f"output {k}: NaNs in different places"
            finite = np.isfinite(yf)
            if not np.array_equal(np.isinf(xf) & ~finite, np.isinf(yf) & ~finite) or not np.array_equal(
                xf[~finite & ~np.isnan(yf)], yf[~finite & ~np.isnan(yf)]
            ):
                return f"output {k}: infinities differ"
            if finite.any():
                err = float(np.max(np.abs(xf[finite] - yf[finite])))
                scale = max(1.0, float(np.max(np.abs(yf[finite]))))
                if err > tolerance * scale:
                    return f"output {k}: max abs error {err:.3g} > {tolerance:g} x {scale:.3g}"
        elif not np.array_equal(x, y):
            return f"output {k}: {int(np.sum(x != y))} of {x.size} elements differ"
    return None
