#!/usr/bin/env python
"""Write a big MLP ONNX model with random weights, to measure a cold compile's time and memory.

    .venv/bin/python scripts/make_big_model.py /tmp/big.onnx --mb 1200
    .venv/bin/python scripts/make_big_model.py /tmp/big.onnx --mb 300 --external

The model is ``layers`` blocks of ``x = Relu(x @ W_i + b_i)`` on a ``[batch, hidden]``
float32 input (``batch`` symbolic), with the number of layers chosen so the weights
total about ``--mb`` MiB. ``--external`` keeps the weights in ``<model>.data`` beside
the model (ONNX external data) instead of inside it. Weights are N(0, 1/hidden), so
activations stay finite through any depth. Never commit what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper


def build(mb: float, hidden: int, seed: int = 0) -> tuple[onnx.ModelProto, int]:
    """(the model, its weight bytes): enough layers of ``hidden`` x ``hidden`` for about ``mb`` MiB."""
    per_layer = (hidden * hidden + hidden) * 4
    layers = max(1, round(mb * (1 << 20) / per_layer))
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / np.sqrt(hidden))
    nodes, inits = [], []
    x = "x"
    for i in range(layers):
        w = rng.standard_normal((hidden, hidden), dtype=np.float32) * scale
        b = rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.01)
        inits.append(_tensor(f"w{i}", w))
        inits.append(_tensor(f"b{i}", b))
        del w, b
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=f"add{i}"))
        y = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("Relu", [f"add{i}"], [y], name=f"relu{i}"))
        x = y
    graph = helper.make_graph(
        nodes,
        "big_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, layers * per_layer


def _tensor(name: str, array: np.ndarray) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape)
    t.raw_data = array.tobytes()
    return t


def main(argv: list[str] | None = None) -> int:
    """Write the model; print its path, layer count and weight bytes."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the .onnx file to write")
    p.add_argument("--mb", type=float, default=1200.0, help="weight size in MiB (default 1200)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden width (default 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--external", action="store_true", help="weights in <out>.data (ONNX external data)")
    args = p.parse_args(argv)
    model, nbytes = build(args.mb, args.hidden, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.external:
        onnx.save_model(model, out, save_as_external_data=True, location=out.name + ".data", size_threshold=1024)
    else:
        out.write_bytes(model.SerializeToString())
    layers = len(model.graph.initializer) // 2
    print(f"{out}: {layers} layers of {args.hidden}, {nbytes:,} weight bytes ({nbytes / (1 << 20):.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
