"""Decode-attention graphs as exporters write them, for the attention template's tests.

``build(heads, kv_heads, length, dim, dtype)`` makes the chain a Llama-style export has
for one decode step: K and V caches of ``kv_heads`` heads repeated to ``heads`` (GQA:
Unsqueeze, Expand, Reshape), K transposed, the scores product, a scale, an additive length
mask, Softmax, a cast, the weighted sum with V. Run as a script it checks every fusion group
of every case under Triton's interpreter and prints one JSON line of results.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

CASES = [  # heads, kv heads, KV positions, valid positions, head dim
    (4, 4, 64, 1, 16),
    (6, 2, 300, 255, 32),
    (8, 2, 300, 257, 16),
    (4, 1, 96, 95, 64),
    (3, 3, 40, 40, 24),
]


def model(heads: int, kv_heads: int, length: int, dim: int, mode: str, dtype: str = "float32", **kw: Any) -> Any:
    """``build``'s graph compiled from ONNX (as a user's export is: with inferred shapes)."""
    import tempfile

    import onnx

    import dsp_core as dsp
    from dsp_core.ir.onnx_export import to_onnx

    path = Path(tempfile.mkdtemp(prefix="dsp-attention-")) / "attention.onnx"
    onnx.save(to_onnx(build(heads, kv_heads, length, dim, dtype)), str(path))
    return dsp.compile(path, mode=mode, **kw)


def build(heads: int, kv_heads: int, length: int, dim: int, dtype: str = "float32") -> Any:
    import dsp_core as dsp

    g = dsp.GraphBuilder()
    q = g.placeholder("q", dtype, [1, heads, 1, dim])
    k = g.placeholder("k_cache", dtype, [1, kv_heads, length, dim])
    v = g.placeholder("v_cache", dtype, [1, kv_heads, length, dim])
    mask = g.placeholder("mask", dtype, [1, 1, 1, length])
    rep = heads // kv_heads

    def repeat(x: Any) -> Any:
        if rep == 1:
            return x
        u = g.Unsqueeze(x, g.constant(np.array([2], dtype=np.int64)))
        e = g.Expand(u, g.constant(np.array([1, kv_heads, rep, length, dim], dtype=np.int64)))
        return g.Reshape(e, g.constant(np.array([1, heads, length, dim], dtype=np.int64)))

    kt = g.Transpose(repeat(k), perm=[0, 1, 3, 2])
    scores = g.MatMul(q, kt)
    scaled = g.Mul(scores, g.constant(np.array(1.0 / np.sqrt(dim), dtype=dtype)))
    probs = g.Softmax(g.Add(scaled, mask), axis=-1)
    out = g.MatMul(g.Cast(probs, to={"float32": 1, "float16": 10, "bfloat16": 16}[dtype]), repeat(v))
    g.output(
        g.Reshape(g.Transpose(out, perm=[0, 2, 1, 3]), g.constant(np.array([1, 1, heads * dim], dtype=np.int64))), "y"
    )
    return g.build()


def feeds(
    heads: int, kv_heads: int, length: int, valid: int, dim: int, dtype: str = "float32"
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(heads * 1000 + length)
    mask = np.zeros((1, 1, 1, length), dtype=dtype)
    mask[..., valid:] = -np.inf
    return {
        "q": rng.standard_normal((1, heads, 1, dim)).astype(dtype),
        "k_cache": rng.standard_normal((1, kv_heads, length, dim)).astype(dtype),
        "v_cache": rng.standard_normal((1, kv_heads, length, dim)).astype(dtype),
        "mask": mask,
    }


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).parent))
    import interpret_check as ic

    results = []
    for heads, kv, length, valid, dim in CASES:
        compiled = model(heads, kv, length, dim, "slot_by_slot")
        for r in ic.check_model(compiled, feeds(heads, kv, length, valid, dim)):
            results.append({"case": [heads, kv, length, valid, dim], **r.__dict__})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
