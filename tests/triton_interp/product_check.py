"""The skinny-product template (T3) under Triton's interpreter: every body and every tuning config.

Cases cover MatMul (batched, broadcast batch, weights laid out [K, N] and [N, K]), Gemm
(transA, transB, alpha, beta, bias), rows 1..16, K and N that are not multiples of the
blocks, fp32 and fp16, and an epilogue (bias, GELU, residual, a reshape). Each kernel's
outputs are compared with numpy within the TRITON contract's tolerance. Prints one JSON
line: a list of ``{case, config, status, detail}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"


def _case(name: str, rng: np.random.Generator, **kw: Any) -> dict[str, Any]:
    return {"name": name, "rng": rng, **kw}


def cases() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for m in (1, 3, 16):
        for k, n in ((37, 50), (130, 7), (64, 2)):
            out.append(_case(f"matmul m{m} k{k} n{n}", rng, op="MatMul", a=(m, k), b=(k, n), dtype="float32"))
    out.append(_case("matmul nk weights", rng, op="MatMul", a=(1, 300), b=(300, 70), dtype="float32", nk=True))
    out.append(_case("matmul fp16 nk", rng, op="MatMul", a=(1, 1, 520), b=(520, 96), dtype="float16", nk=True))
    out.append(_case("matmul batched", rng, op="MatMul", a=(2, 3, 1, 24), b=(2, 3, 24, 19), dtype="float32"))
    out.append(_case("matmul broadcast batch", rng, op="MatMul", a=(2, 5, 40), b=(40, 33), dtype="float32"))
    out.append(
        _case("matmul batched nk", rng, op="MatMul", a=(1, 4, 1, 16), b=(1, 4, 16, 45), dtype="float32", nk=True)
    )
    for ta, tb in ((0, 0), (0, 1), (1, 0), (1, 1)):
        out.append(
            _case(
                f"gemm tA{ta} tB{tb}", rng, op="Gemm", a=(1, 75), b=(75, 20), dtype="float32", ta=ta, tb=tb, bias=True
            )
        )
    out.append(
        _case(
            "gemm m5 alpha beta", rng, op="Gemm", a=(5, 33), b=(33, 18), dtype="float32", bias=True, alpha=0.5, beta=2.0
        )
    )
    out.append(_case("matmul + epilogue", rng, op="MatMul", a=(1, 1, 90), b=(90, 40), dtype="float32", epilogue=True))
    out.append(
        _case("matmul fp16 + epilogue", rng, op="MatMul", a=(1, 4, 64), b=(64, 48), dtype="float16", epilogue=True)
    )
    for m in (1, 5, 16):  # a norm as the prologue: RMSNorm, LayerNorm, the exported RMSNorm chain
        for norm in ("rms", "layer", "chain"):
            out.append(
                _case(
                    f"{norm} norm + matmul m{m}",
                    rng,
                    op="MatMul",
                    a=(1, m, 130),
                    b=(130, 37),
                    dtype="float32",
                    norm=norm,
                )
            )
    out.append(
        _case(
            "chain norm + matmul fp16 nk",
            rng,
            op="MatMul",
            a=(1, 1, 520),
            b=(520, 96),
            dtype="float16",
            nk=True,
            norm="chain",
        )
    )
    out.append(
        _case("layer norm + matmul fp16 m4", rng, op="MatMul", a=(4, 72), b=(72, 40), dtype="float16", norm="layer")
    )
    return out


def _norm(
    case: dict[str, Any], x: np.ndarray, arrays: dict[int, np.ndarray], values: dict[int, np.ndarray]
) -> list[Any]:
    """The nodes of a norm of ``x`` (value 20) that make the product's A (value 1); fills ``arrays`` and ``values``."""
    from dsp_triton import codegen

    rng, dt, kind = case["rng"], x.dtype, case["norm"]
    gamma = (1 + 0.1 * rng.standard_normal(x.shape[-1])).astype(dt)
    beta = (0.1 * rng.standard_normal(x.shape[-1])).astype(dt)
    arrays.update({20: x, 21: gamma})
    xf = x.astype(np.float64)
    n = codegen.NodeSpec
    if kind == "layer":
        arrays[22] = beta
        d = xf - xf.mean(-1, keepdims=True)
        y = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5) * gamma + beta
        nodes = [n("LayerNormalization", (20, 21, 22), (1,), {"axis": -1, "epsilon": 1e-5})]
    elif kind == "rms":
        y = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * gamma
        nodes = [n("RMSNormalization", (20, 21), (1,), {"axis": -1, "epsilon": 1e-6}, opset=23)]
    else:  # as the eager export writes it
        arrays.update({40: np.array(2.0, dt), 41: np.array([-1], np.int64), 42: np.array(1e-6, dt)})
        sq = xf * xf
        mean = sq.mean(-1, keepdims=True)
        inv = 1 / np.sqrt(mean + 1e-6)
        y = gamma * (xf * inv)
        values.update({30: sq.astype(dt), 31: mean.astype(dt), 32: (mean + 1e-6).astype(dt)})
        values.update({33: np.sqrt(mean + 1e-6).astype(dt), 34: inv.astype(dt), 35: (xf * inv).astype(dt)})
        nodes = [
            n("Pow", (20, 40), (30,)),
            n("ReduceMean", (30, 41), (31,), {"keepdims": 1}, opset=18),
            n("Add", (31, 42), (32,)),
            n("Sqrt", (32,), (33,)),
            n("Reciprocal", (33,), (34,)),
            n("Mul", (20, 34), (35,)),
            n("Mul", (21, 35), (1,)),
        ]
    values.update({k: v for k, v in arrays.items() if k >= 20})
    values[1] = y.astype(dt)
    return nodes


def build(case: dict[str, Any]) -> tuple[Any, dict[int, np.ndarray], dict[int, np.ndarray]]:
    """The group's GroupSpec, its input arrays (by value id) and the expected outputs."""
    from dsp_triton import codegen

    rng, dt = case["rng"], case["dtype"]
    ta, tb = case.get("ta", 0), case.get("tb", 0)
    a_shape = tuple(reversed(case["a"])) if ta else case["a"]
    b_shape = tuple(reversed(case["b"])) if tb else case["b"]
    a = rng.standard_normal(a_shape).astype(dt)
    b = rng.standard_normal(b_shape).astype(dt)
    if case.get("nk"):
        b = np.ascontiguousarray(np.swapaxes(b, -1, -2)).swapaxes(-1, -2)  # [.., K, N] with K the unit stride
    arrays: dict[int, np.ndarray] = {1: a, 2: b}
    values: dict[int, np.ndarray] = {}
    nodes = []
    if case.get("norm"):  # A is the norm of x, made in the kernel
        del arrays[1]
        nodes += _norm(case, a, arrays, values)
        a = values[1]
    af, bf = a.astype(np.float64), b.astype(np.float64)
    if case["op"] == "Gemm":
        attrs = {"transA": ta, "transB": tb, "alpha": case.get("alpha", 1.0), "beta": case.get("beta", 1.0)}
        n = case["b"][1]
        c = rng.standard_normal((n,)).astype(dt)
        arrays[3] = c
        y = attrs["alpha"] * ((af.T if ta else af) @ (bf.T if tb else bf)) + attrs["beta"] * c.astype(np.float64)
        nodes.append(codegen.NodeSpec("Gemm", (1, 2, 3), (4,), attrs))
    else:
        y = af @ bf
        nodes.append(codegen.NodeSpec("MatMul", (1, 2), (4,)))
    y = y.astype(dt)
    values.update({1: a, 2: b, 4: y})
    if case["op"] == "Gemm":
        values[3] = arrays[3]
    outputs = [4]
    if case.get("epilogue"):
        n = y.shape[-1]
        bias = rng.standard_normal((n,)).astype(dt)
        res = rng.standard_normal(y.shape).astype(dt)
        arrays[5], arrays[7] = bias, res
        t = (y.astype(np.float64) + bias).astype(dt)
        g = (
            0.5 * t.astype(np.float64) * (1 + np.tanh(0.7978845608 * (t + 0.044715 * t.astype(np.float64) ** 3)))
        ).astype(dt)
        r = (g.astype(np.float64) + res).astype(dt)
        flat = r.reshape(-1, n)
        nodes += [
            codegen.NodeSpec("Add", (4, 5), (6,)),
            codegen.NodeSpec("Gelu", (6,), (8,), {"approximate": "tanh"}, opset=20),
            codegen.NodeSpec("Add", (8, 7), (9,)),
            codegen.NodeSpec("Reshape", (9, 10), (11,)),
        ]
        arrays[10] = np.array(flat.shape, dtype=np.int64)
        values.update({5: bias, 6: t, 7: res, 8: g, 9: r, 10: arrays[10], 11: flat})
        outputs = [8, 11]  # an intermediate read outside, and the reshaped result
    specs = {}
    for v, x in values.items():
        strides = tuple(s // x.itemsize for s in x.strides) if v in arrays else None
        specs[v] = codegen.TensorSpec(tuple(x.shape), str(x.dtype), strides)
    ins = [v for v in arrays]
    small = {v: x for v, x in arrays.items() if x.size <= 16 and (x.dtype.kind == "i" or v >= 40)}
    # an [N, K] weight stands for the kernel's Derived copy: a constant it may load before it waits
    params = {"fixed_b": 1} if case.get("nk") else {}
    spec = codegen.GroupSpec("product", nodes, specs, ins, outputs, lambda v: small.get(v), params=params)
    return spec, arrays, {v: values[v] for v in outputs}


def run() -> list[dict[str, Any]]:
    import torch
    from dsp_triton import codegen
    from dsp_triton.kernels import _mismatch

    sys.path.insert(0, str(Path(__file__).parent))
    from interpret_check import _NumpyAsCupy, _torch_view, load_kernel

    tmp = Path(tempfile.mkdtemp(prefix="dsp-triton-product-"))
    results = []
    for case in cases():
        spec, arrays, want = build(case)
        shape = codegen.product_shape(spec)
        for config in codegen.product_configs(shape, preload=bool(spec.params.get("fixed_b"))):
            entry = {"case": case["name"], "body": shape.body, "config": config}
            try:
                kernel = codegen.generate(spec, config=config)
                if config.get("preload"):  # its weight loads come first, then the place a launch waits
                    lines = kernel.source.split("\n")
                    assert lines.index(codegen.WAIT_MARKER) < min(k for k, x in enumerate(lines) if "for k0" in x)
                fn = load_kernel(tmp, kernel)
                args = [_torch_view(torch, arrays[v]) for v in kernel.args[: kernel.n_inputs]]
                outs = [
                    np.zeros(spec.values[v].shape, dtype=spec.values[v].dtype) for v in kernel.args[kernel.n_inputs :]
                ]
                args += [torch.from_numpy(o) for o in outs]
                fn[kernel.grid](*args, num_warps=kernel.num_warps)
                got = dict(zip(kernel.args[kernel.n_inputs :], outs))
                bad = _mismatch([got[v] for v in want], list(want.values()), 5e-3, _NumpyAsCupy)
                entry.update(status="ok" if bad is None else "mismatch", detail=bad or "")
            except Exception as exc:  # noqa: BLE001
                entry.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:2000])
            results.append(entry)
    return results


if __name__ == "__main__":
    print(json.dumps(run()))
