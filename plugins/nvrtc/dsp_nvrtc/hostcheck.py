"""Generated kernels checked without a GPU: compiled by NVRTC, and run on the host by a C++ compiler.

``run_on_host`` builds a kernel's ``host_source`` (the same body after ``HOST_PRELUDE``) with
``c++`` into a shared library and runs its grid block after block (a row kernel with one
thread a block, so its block reduction is the thread's own sum). ``check_model`` does this
for every fusion group of a model under the NVRTC policy, on the values of one slot-by-slot
run, and compares each kernel's outputs with the reference's. Used by the CPU tests; handy
when a generated kernel is suspected (``python -m dsp_nvrtc.hostcheck model.onnx feeds.npz``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsp_nvrtc import codegen

_LIBS: dict[str, ctypes.CDLL] = {}


def host_compiler() -> str | None:
    """The C++ compiler ``run_on_host`` uses (``$CXX``, else ``c++``/``g++``), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    return None


def _build(kernel: codegen.Kernel, ctypes_of: list[str]) -> ctypes.CDLL:
    # one thread a block: its own value is the block's
    block_reductions = ("row_reduction", "argmax", "decode_attention", "decode_attention_combine")
    threads = 1 if kernel.template in block_reductions else kernel.threads
    casts = [f"({t}*)a[{k}]" for k, t in enumerate(ctypes_of)]
    driver = (
        'extern "C" void dsp_run(void** a) {\n'
        f"    blockDim.x = {threads};\n"
        f"    for (unsigned int b = 0; b < {kernel.grid}u; ++b) {{\n"
        "        blockIdx.x = b;\n"
        f"        for (unsigned int t = 0; t < {threads}u; ++t) {{\n"
        f"            threadIdx.x = t;\n            {kernel.name}({', '.join(casts)});\n        }}\n"
        "    }\n}\n"
    )
    source = kernel.host_source() + driver
    tag = hashlib.blake2b(source.encode(), digest_size=10).hexdigest()
    lib = _LIBS.get(tag)
    if lib is not None:
        return lib
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    folder = Path(tempfile.gettempdir()) / "dsp-nvrtc-host"
    folder.mkdir(exist_ok=True)
    src, out = folder / f"{tag}.cpp", folder / f"{tag}.so"
    src.write_text(source)
    done = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{cxx} could not build {kernel.name} ({src}):\n{done.stderr[-3000:]}")
    lib = ctypes.CDLL(str(out))
    _LIBS[tag] = lib
    return lib


def run_on_host(
    kernel: codegen.Kernel, spec: codegen.GroupSpec, arrays: dict[int, np.ndarray]
) -> dict[int, np.ndarray]:
    """Run ``kernel`` on the host over ``arrays`` (its inputs, with the strides ``spec`` gives); its outputs.

    An output given in ``arrays`` is written in place (a KV store's buffer); the others are new.
    """
    ins = kernel.args[: kernel.n_inputs]
    outs = {
        v: arrays[v] if v in arrays else np.empty(spec.values[v].shape, dtype=_np_dtype(spec.values[v].dtype))
        for v in kernel.args[len(ins) :]
    }
    ctypes_of = [
        ("const " if k < len(ins) else "") + codegen.C_TYPES[spec.values[v].dtype][0] for k, v in enumerate(kernel.args)
    ]
    lib = _build(kernel, ctypes_of)
    pointers = [arrays[v].__array_interface__["data"][0] for v in ins] + [
        a.__array_interface__["data"][0] for a in outs.values()
    ]
    argv = (ctypes.c_void_p * len(pointers))(*pointers)
    lib.dsp_run(argv)
    return outs


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


@dataclass
class GroupCheck:
    """One group's verdict: ``ok``, ``mismatch``, ``unsupported`` (with the reason) or ``error``."""

    segment: int
    group: int
    template: str
    ops: list[str]
    status: str
    detail: str = ""
    kernel: str = ""


def group_specs(model: Any, feeds: dict[str, np.ndarray]) -> list[tuple[Any, Any, codegen.GroupSpec, list[Any]]]:
    """(segment, group, its GroupSpec on the reference's values, the values) for every generated group."""
    from dsp_cpu_ref.slot_by_slot import plan_values
    from dsp_cuda_graphs.segment import tainted_flats

    from dsp_core.plan.fusion import propose_groups
    from dsp_core.plan.kernelspec import node_specs
    from dsp_nvrtc.plugin import NvrtcPolicy
    from dsp_nvrtc.segment import unfused_reason

    plan, part, values = plan_values(model, feeds)
    tainted = tainted_flats(plan)
    found = []
    for seg in part.segments:
        for g in propose_groups(plan, seg.slots, NvrtcPolicy()).groups:
            if unfused_reason(plan, g) is not None:
                continue
            nodes = node_specs(plan, g.slots)
            produced = {o for n in nodes for o in n.outputs if o is not None}
            ins = list(dict.fromkeys(i for n in nodes for i in n.inputs if i is not None and i not in produced))
            specs: dict[int, codegen.TensorSpec] = {}
            for flat in {*ins, *produced}:
                x = values[flat]
                if x is None:
                    continue
                x = np.asarray(x)
                strides = tuple(s // x.itemsize for s in x.strides) if flat in ins else None
                specs[flat] = codegen.TensorSpec(tuple(x.shape), str(x.dtype), strides)

            def constant(v: int) -> np.ndarray | None:
                x = values[v]
                return None if v in tainted or x is None or np.asarray(x).size > 4096 else np.asarray(x)

            outs = [plan.flat(v) for v in g.outputs]
            found.append((seg, g, codegen.GroupSpec(g.template, nodes, specs, ins, outs, constant), values))
    return found


def check_model(
    model: Any, feeds: dict[str, np.ndarray], tolerance: float = 5e-3, nvrtc: bool = True
) -> list[GroupCheck]:
    """Every generated group of ``model`` compiled (NVRTC, when ``nvrtc``) and run on the host against the reference."""
    from dsp_cuda_graphs.fusion import mismatch

    from dsp_nvrtc import compiler

    results: list[GroupCheck] = []
    for seg, g, spec, values in group_specs(model, feeds):
        ops = [n.op for n in spec.nodes]
        try:
            kernel, spec, joined = _kernel(spec, values)
        except codegen.Unsupported as exc:
            results.append(GroupCheck(seg.index, g.index, g.template, ops, "unsupported", str(exc)))
            continue
        try:
            if nvrtc:
                compiler.compile_source(kernel.device_source(), kernel.name, compiler.Target("compute_75"))
            arrays = {v: joined[v] if v in joined else np.asarray(values[v]) for v in kernel.args[: kernel.n_inputs]}
            for v, x in arrays.items():  # a value the group stores between its parts: row-major
                if v not in spec.inputs or spec.values[v].strides == tuple(codegen.row_major(x.shape)):
                    arrays[v] = np.ascontiguousarray(x)
            for out, _ in kernel.kv_stores:  # the buffer as the reference left it, its new rows poisoned
                arrays[out] = _poisoned_rows(spec, out, values)
            got = run_on_host(kernel, spec, arrays)
        except Exception as exc:  # noqa: BLE001
            results.append(GroupCheck(seg.index, g.index, g.template, ops, "error", f"{exc}", kernel.name))
            continue
        bad = mismatch([got[o] for o in spec.outputs], [values[o] for o in spec.outputs], tolerance, np.asarray)
        status = "ok" if bad is None else "mismatch"
        results.append(GroupCheck(seg.index, g.index, g.template, ops, status, bad or "", kernel.name))
    return results


def _poisoned_rows(spec: codegen.GroupSpec, out: int, values: list[Any]) -> np.ndarray:
    """A copy of the buffer a KV store of the group wrote (``out``, as the reference left it) whose rows
    that store wrote are NaN (or an integer's largest value): the kernel must write them again."""
    node = next(n for n in spec.nodes if n.op == "KVScatter" and n.outputs[0] == out)
    buffer = np.array(values[out])  # a C-ordered copy, as the buffer's strides in the spec say
    update, position = (np.asarray(values[int(v)]) for v in node.inputs[1:3])  # type: ignore[arg-type]
    ax = int(node.attrs.get("axis", -2)) % buffer.ndim
    start = int(position.reshape(-1)[0])
    start += buffer.shape[ax] if start < 0 else 0
    rows = (slice(None),) * ax + (slice(start, start + update.shape[ax]),)
    bad = np.nan if np.issubdtype(buffer.dtype, np.floating) else np.iinfo(buffer.dtype).max
    buffer[rows] = bad
    return buffer


def _kernel(
    spec: codegen.GroupSpec, values: list[Any]
) -> tuple[codegen.Kernel, codegen.GroupSpec, dict[int, np.ndarray]]:
    """The group's kernel, the spec it runs on and the arrays it reads that the plan does not hold, as
    the segment builds them: merged products over their weights joined into one [sum N, K] array
    (``merged_product`` alone, ``merged_spec`` with a norm prologue or a pairwise epilogue); for a
    layout the kernel declines (a prompt's rows), the part the segment generates: a product's norm
    prologue as its own row kernel (``codegen.prologue_parts``), a decode attention's softmax
    (``codegen.attention_parts``)."""
    try:
        if codegen.merged_index(spec) >= 0:
            return merged_kernel(spec, lambda v: np.asarray(values[v]))
        return codegen.generate(spec), spec, {}
    except codegen.Unsupported as exc:
        if spec.template == "product" and any(n.op in codegen.PROLOGUE_REDUCTIONS for n in spec.nodes):
            _, part, _ = codegen.prologue_parts(spec)  # a prompt's rows: the norm as its own kernel
        elif spec.template == "decode_attention" and "query rows" in str(exc):
            _, part, _ = codegen.attention_parts(spec)
        else:
            raise
        return codegen.generate(part), part, {}


def merged_kernel(
    spec: codegen.GroupSpec, array: Callable[[int], np.ndarray], cols: int = 1
) -> tuple[codegen.Kernel, codegen.GroupSpec, dict[int, np.ndarray]]:
    """A merged products' group on the host: its joined weights (and biases) built with numpy as the
    segment builds them with CuPy, then its kernel (a warp's lanes per output)."""
    from dsp_cuda_graphs.derived import joined_bias, joined_nk

    node = spec.nodes[codegen.merged_index(spec)]
    weights, biases = codegen.merged_operands(node)
    trans_b = str(node.attrs.get("form", "MatMul")) == "Gemm" and int(node.attrs.get("transB", 0)) == 1
    joined = {codegen.MERGED_B: joined_nk(trans_b)(np, [array(w) for w in weights])}
    if biases:
        joined[codegen.MERGED_C] = joined_bias(np, [array(c) for c in biases])
    specs = {
        v: codegen.TensorSpec(x.shape, str(x.dtype), tuple(st // x.itemsize for st in x.strides))
        for v, x in joined.items()
    }
    kernel, spec = codegen.merged_group(spec, specs, cols)
    return kernel, spec, joined


def main() -> int:
    """``python -m dsp_nvrtc.hostcheck MODEL.onnx FEEDS.npz``: one line per group; exit 1 on a bad kernel."""
    import sys

    import dsp_core as dsp

    if len(sys.argv) != 3:
        print("usage: python -m dsp_nvrtc.hostcheck MODEL.onnx FEEDS.npz (one array per input name)")
        return 2
    model = dsp.compile(sys.argv[1], mode="slot_by_slot")
    z = np.load(sys.argv[2])
    bad = 0
    for r in check_model(model, {n: z[n] for n in model.input_names}):
        bad += r.status in ("mismatch", "error")
        print(f"segment {r.segment} group {r.group} {r.template:13s} {r.status:11s} {'+'.join(r.ops)} {r.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
