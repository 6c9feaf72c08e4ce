"""Regenerate plugins/openvino/dsp_openvino/ops.py: the ONNX ops OpenVINO's frontend converts.

For every op of DSP's table in the default domain, a one-node ONNX model (inputs of
unknown rank) is read by OpenVINO's ONNX frontend; "No conversion rule found" means it
does not take the op. Each op is probed in a child process, since a probe can crash
the frontend (an op whose probe crashes is probed again with typed inputs, then left
out if it crashes again). Run after an OpenVINO upgrade:

    .venv/bin/python scripts/openvino_op_table.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "plugins" / "openvino" / "dsp_openvino" / "ops.py"

_CHILD = r"""
import sys
import onnx, openvino
from onnx import helper
op, n_in, opset, typed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "typed"
if typed:  # a float image and int64 vectors (pads, shapes, axes): what most multi-input ops take
    ins = [helper.make_tensor_value_info("i0", onnx.TensorProto.FLOAT, [1, 3, 4, 4])]
    ins += [helper.make_tensor_value_info(f"i{k}", onnx.TensorProto.INT64, [8]) for k in range(1, n_in)]
else:
    ins = [helper.make_tensor_value_info(f"i{k}", onnx.TensorProto.FLOAT, None) for k in range(n_in)]
node = helper.make_node(op, [f"i{k}" for k in range(n_in)], ["o"])
graph = helper.make_graph([node], "probe", ins, [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, None)])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
model.ir_version = 10
try:
    openvino.Core().read_model(model.SerializeToString(), b"")
except Exception as exc:
    print("NO" if "No conversion rule found" in str(exc) else "YES")
else:
    print("YES")
"""


def probe(op: str, n_in: int, opset: int, typed: bool = False) -> bool | None:
    """True: converts; False: no conversion rule; None: the frontend crashed or hung."""
    args = [op, str(n_in), str(opset), "typed" if typed else "untyped"]
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    word = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return {"YES": True, "NO": False}.get(word[0]) if word else None


def main() -> int:
    """Probe every op and write the table."""
    import openvino

    from dsp_core.ops.registry import all_ops

    takes, crashes = [], []
    ops = [d for d in all_ops() if d.domain == ""]
    for k, opdef in enumerate(ops):
        answer = probe(opdef.name, max(opdef.inputs[0], 1), max(opdef.since, 17))
        if answer is None:  # unknown ranks crashed it: again with typed inputs, as a model has them
            answer = probe(opdef.name, max(opdef.inputs[0], 2), max(opdef.since, 17), typed=True)
        print(f"[{k + 1}/{len(ops)}] {opdef.name}: {answer}", file=sys.stderr)
        if answer:
            takes.append(opdef.name)
        elif answer is None:
            crashes.append(opdef.name)
    version = openvino.__version__.split("-")[0]
    lines = [
        f'"""ONNX ops the ONNX frontend of OpenVINO {version} converts (scripts/openvino_op_table.py wrote this)."""',
        "",
        "# Ops whose one-node probe crashed the frontend are left out (the reference runs them):",
        f"# {', '.join(crashes) or 'none'}",
        "CONVERTS = frozenset(",
        "    {",
        *[f'        "{name}",' for name in takes],
        "    }",
        ")",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}: {len(takes)} ops", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
