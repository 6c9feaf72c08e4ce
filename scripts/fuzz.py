#!/usr/bin/env python3
"""Fuzz ``dsp.compile`` and ``model.run`` with mutated ONNX models, under a supervisor.

    python scripts/fuzz.py --time 120                 # what `make fuzz` runs
    python scripts/fuzz.py --cases 1000000 --jobs 2   # stop after N inputs
    python scripts/fuzz.py --replay fuzz-out/crashes/X.onnx   # one reproducer, in-process
    python scripts/fuzz.py --regen 12345              # the bytes of case 12345 of --seed S

The supervisor builds the seed corpus once (the small ONNX fixtures, ONNX's node test
suite, the models of the known findings), then runs ``--jobs`` worker processes. A
worker loads the corpus once and runs case after case: case ``id`` is seed model plus
stacked protobuf-level and byte-level mutations drawn from ``Random(f"{seed}:{id}")``,
so ``--seed`` and the id regenerate it. Before each case the worker writes the input to
its ``current`` file and announces the id on a pipe; the supervisor kills a worker whose
case runs past ``--timeout`` (C++ shape inference can loop holding the GIL, so only a
kill from outside is reliable) and saves the input of a worker that died by a signal.
Workers run under RLIMIT_AS (``--mem-mb`` above their baseline). docs/fuzzing.md says
what each outcome means; any crash, hang, blow-up or non-DSPError makes the exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import importlib.util
import json
import logging
import math
import os
import random
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Outcome classes. The first three are fine; the four after them are failures.
OK, DSP, HARNESS = "ok", "dsp", "harness"
NONDSP, BLOWUP, CRASH, HANG = "nondsp", "blowup", "crash", "hang"
MISMATCH = "mismatch"  # run and run_legacy disagree: reported, a failure with --fail-on-mismatch
FAILURES = (NONDSP, BLOWUP, CRASH, HANG)
CLASSES = (OK, DSP, NONDSP, BLOWUP, CRASH, HANG, MISMATCH, HARNESS)
REPRO_DIRS = {
    NONDSP: "nondsp",
    BLOWUP: "blowups",
    CRASH: "crashes",
    HANG: "hangs",
    MISMATCH: "mismatch",
    HARNESS: "harness",
}
BLOWUP_EXIT = 3  # a worker exits with this after a MemoryError: its heap may be in pieces


# --------------------------------------------------------------------------------------
# Seed corpus
# --------------------------------------------------------------------------------------


def fixture_seeds(max_kb: int) -> list[tuple[str, bytes]]:
    """The ONNX files under tests/fixtures of at most ``max_kb`` KiB."""
    seeds = []
    for path in sorted((ROOT / "tests" / "fixtures").rglob("*.onnx")):
        if path.stat().st_size <= max_kb * 1024:
            seeds.append((f"fixture:{path.relative_to(ROOT / 'tests' / 'fixtures')}", path.read_bytes()))
    return seeds


def node_suite_seeds() -> list[tuple[str, bytes]]:
    """ONNX's node test models: built in memory by onnx >= 1.23, shipped as files before."""
    import onnx

    folder = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    if folder.is_dir():
        return [(f"node:{p.parent.name}", p.read_bytes()) for p in sorted(folder.glob("*/model.onnx"))]
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    return [(f"node:{c.name}", c.model.SerializeToString()) for c in cases if c.model is not None]


def repro_seeds() -> list[tuple[str, bytes]]:
    """The models of the known findings (issue 12, ../shared/repro/), rebuilt here."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def vi(name: str, elem: int, shape: Any) -> Any:
        return helper.make_tensor_value_info(name, elem, shape)

    def model(nodes: list[Any], ins: list[Any], outs: list[Any], inits: Any = (), opset: int = 23, **kw: Any) -> bytes:
        graph = helper.make_graph(nodes, "g", ins, outs, list(inits), value_info=kw.pop("value_info", None))
        domain = kw.pop("domain", "")
        return helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, opset)], **kw).SerializeToString()

    f = TensorProto.FLOAT
    x2, y_any = vi("x", f, [2]), vi("y", f, None)
    seeds: dict[str, bytes] = {}
    const = helper.make_tensor("c", TensorProto.INT32, [4], [1, 2, 3, 1])
    seeds["add_mixed_dtypes"] = model(
        [helper.make_node("Add", ["c", "x"], ["y"])], [vi("x", f, [4])], [vi("y", f, [4])], [const]
    )
    w = numpy_helper.from_array(np.eye(2, dtype=np.float32) * 10, "W")
    x22 = vi("x", f, [2, 2])
    seeds["duplicate_input"] = model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], [x22, x22], [vi("y", f, [2, 2])], [w]
    )
    seeds["extra_output"] = model(
        [helper.make_node("Relu", ["x"], ["y", "z"])], [vi("x", f, [3])], [vi("y", f, [3]), vi("z", f, [3])]
    )
    einsum = helper.make_node("Einsum", ["x"], ["y"], equation=b"\xff\xfe")
    seeds["hang_einsum"] = model(
        [einsum], [vi("x", TensorProto.DOUBLE, [])], [vi("x", TensorProto.DOUBLE, [])], opset=12
    )
    seeds["constant_extra_attr"] = model(
        [helper.make_node("Constant", [], ["y"], value_float=1.0, axis=0)], [x2], [y_any]
    )
    seeds["constant_no_value"] = model([helper.make_node("Constant", [], ["y"])], [x2], [y_any])
    seeds["attr_name_not_utf8"] = model([helper.make_node("Relu", ["x"], ["y"], zzzz=1)], [x2], [y_any]).replace(
        b"zzzz", b"\xff\xfezz"
    )
    ext = numpy_helper.from_array(np.ones(2, np.float32), "w")
    ext.data_location = TensorProto.EXTERNAL
    entry = ext.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    ext.ClearField("raw_data")
    add_w = [helper.make_node("Add", ["x", "w"], ["y"])]
    seeds["external_data_from_bytes"] = model(add_w, [x2], [y_any], [ext])
    entry.value = "/etc/hostname"
    seeds["external_data_absolute"] = model(add_w, [x2], [y_any], [ext])
    for op in ("RegexFullMatch", "EyeLike", "TreeEnsemble"):
        seeds[f"segv_dangling_{op}"] = model(
            [helper.make_node(op, ["nonexistent"], ["y"])], [vi("x", f, [2, 2])], [y_any], opset=22
        )
    layer_norm = helper.make_node("LayerNormalization", ["X", "W", "B"], ["Y", "Mean", "InvStdDev"], axis=2**63 - 1)
    seeds["segv_layernorm_axis"] = model(
        [layer_norm],
        [vi("X", f, [2, 3, 5]), vi("W", f, [5]), vi("B", f, [5])],
        [vi(n, f, None) for n in ("Y", "Mean", "InvStdDev")],
        opset=17,
    )
    tree = helper.make_node(
        "TreeEnsemble",
        [" "],
        ["X"],
        domain="ai.onnx.ml",
        aggregate_function=1,
        leaf_targetids=[0, 1, 0, 1],
        n_targets=2,
        nodes_falseleafs=[0, 1, 1],
        nodes_falsenodeids=[2, 2, 3],
        nodes_featureids=[0, 0, 0],
        nodes_modes=helper.make_tensor("nodes_modes", TensorProto.UINT8, [3], [0, 0, 0]),
        nodes_splits=helper.make_tensor("nodes_splits", TensorProto.DOUBLE, [3], [3.14, 1.2, 4.2]),
        nodes_trueleafs=[0, 1, 1],
        nodes_truenodeids=[1, 0, 1],
        tree_roots=[0],
    )
    seeds["segv_treeensemble"] = model(
        [tree],
        [vi("X", TensorProto.FLOAT8E5M2, [3, 2])],
        [vi("Y", TensorProto.DOUBLE, [3, 2]), vi("X", f, [])],
        opset=1000000,
        domain="ai.onnx.ml",
        ir_version=10,
    )
    i64 = TensorProto.INT64
    range_nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["arange"]),
        helper.make_node("Unsqueeze", ["arange", "zero1"], ["y"]),
    ]
    range_inits = [
        helper.make_tensor("one", i64, [], [1]),
        helper.make_tensor("zero", i64, [], [0]),
        helper.make_tensor("zero1", i64, [1], [0]),
    ]
    seeds["shape_inference_range_dim"] = model(
        range_nodes,
        [vi("x", f, ["batch", "seq"])],
        [vi("y", i64, None)],
        range_inits,
        opset=18,
        value_info=[vi("arange", i64, [2**63 - 1])],
    )
    split = helper.make_node("Split", ["x"], ["a", "b", "c"], num_outputs=2**40)
    seeds["split_num_outputs_hang"] = model([split], [vi("x", f, [6])], [vi(n, f, None) for n in "abc"], opset=18)
    return [(f"repro:{name}", data) for name, data in seeds.items()]


def dir_seeds(folder: Path) -> list[tuple[str, bytes]]:
    """Every file of ``folder`` (and below) as a seed: saved reproducers, a hand-made corpus."""
    return [(f"dir:{p.name}", p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".txt"]


def build_corpus(args: argparse.Namespace) -> list[tuple[str, bytes]]:
    """The seed corpus the options ask for."""
    seeds: list[tuple[str, bytes]] = []
    if not args.no_default_seeds:
        seeds += fixture_seeds(args.max_seed_kb) + node_suite_seeds() + repro_seeds()
    for folder in args.seed_dir:
        seeds += dir_seeds(Path(folder))
    return seeds


def write_corpus(path: Path, seeds: list[tuple[str, bytes]]) -> None:
    """One file of length-prefixed (name, bytes) records that workers read at start."""
    with open(path, "wb") as out:
        for name, data in seeds:
            raw = name.encode()
            out.write(struct.pack("<IQ", len(raw), len(data)) + raw + data)


def read_corpus(path: Path) -> list[tuple[str, bytes]]:
    """The records of :func:`write_corpus`."""
    blob, seeds, pos = path.read_bytes(), [], 0
    while pos < len(blob):
        name_len, data_len = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        name = blob[pos : pos + name_len].decode()
        pos += name_len
        seeds.append((name, blob[pos : pos + data_len]))
        pos += data_len
    return seeds


# --------------------------------------------------------------------------------------
# Mutators
# --------------------------------------------------------------------------------------

INTERESTING_INTS = [0, 1, -1, 2, 3, -2, 7, 64, 255, 256, 65535, 2**31 - 1, 2**31, -(2**31), 2**32, 2**40, 2**62]
INTERESTING_INTS += [2**63 - 1, -(2**63)]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-7, 1e38, 3.4e38, math.inf, -math.inf, math.nan, 2.0**31]
INTERESTING_BYTES = [b"", b"\xff\xfe", b"\x00", b"\xc3", b"a" * 4096, b"ij,jk->ik", b"...->", b"->", b"i,i", b"NOTSET"]
INTERESTING_BYTES += [
    b"constant",
    b"linear",
    b"nearest",
    b"SAME_UPPER",
    b"\xe9t\xe9",
    b"%s%n",
    b"../../x",
    b"/etc/hostname",
]
DOMAINS = ["", "ai.onnx", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training", "bogus", "\u00e9"]
NAMES = ["", "x", "y", "nonexistent", " ", "\u00e9", "a" * 300]
ATTR_NAMES = ["axis", "axes", "perm", "equation", "num_outputs", "to", "mode", "value", "keepdims", "split", "k"]
ATTR_NAMES += ["value_float", "value_ints", "value_string", "body", "then_branch", "alpha", "epsilon", "pads", "zzz"]
EXTERNAL_LOCATIONS = ["weights.bin", "../outside.bin", "/etc/hostname", "/dev/zero", "", "nonexistent.bin", "."]


def pick_int(rng: random.Random) -> int:
    """An integer that trips bounds: extremes and powers of two, or a small one."""
    return rng.choice(INTERESTING_INTS) if rng.random() < 0.7 else rng.randint(-8, 64)


def pick_float(rng: random.Random) -> float:
    """A float that trips numerics: zero, denormals, huge, inf, nan, or a plain one."""
    return rng.choice(INTERESTING_FLOATS) if rng.random() < 0.7 else rng.uniform(-10, 10)


def pick_bytes(rng: random.Random) -> bytes:
    """A byte string for an attribute: non-UTF-8, empty, long, an equation, a path."""
    if rng.random() < 0.8:
        return rng.choice(INTERESTING_BYTES)
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))


def all_graphs(graph: Any) -> list[Any]:
    """A graph and every subgraph under it (If/Loop/Scan bodies), depth first."""
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                found += all_graphs(attr.g)
            for sub in attr.graphs:
                found += all_graphs(sub)
    return found


@dataclass
class Mutation:
    """The state one case's mutators share: its model, the seeds, its rng, a log of what was done."""

    model: Any
    rng: random.Random
    corpus: Corpus
    ops: list[str] = field(default_factory=list)

    def graph(self) -> Any:
        return self.rng.choice(all_graphs(self.model.graph))

    def node(self) -> Any | None:
        graphs = [g for g in all_graphs(self.model.graph) if len(g.node)]
        if not graphs:
            return None
        g = self.rng.choice(graphs)
        return g.node[self.rng.randrange(len(g.node))]

    def value_name(self, graph: Any) -> str:
        names = [n for node in graph.node for n in list(node.input) + list(node.output)]
        names += [v.name for v in graph.input] + [t.name for t in graph.initializer]
        return self.rng.choice(names) if names and self.rng.random() < 0.7 else self.rng.choice(NAMES)

    def tensor_types(self) -> list[Any]:
        """Every ValueInfoProto's tensor type: inputs, outputs, value_info, in every graph."""
        types = []
        for g in all_graphs(self.model.graph):
            for vi in list(g.input) + list(g.output) + list(g.value_info):
                if vi.type.HasField("tensor_type"):
                    types.append(vi.type.tensor_type)
        return types

    def tensors(self) -> list[Any]:
        """Initializers and tensor attributes (Constant's value, ConstantOfShape's value)."""
        found = []
        for g in all_graphs(self.model.graph):
            found += list(g.initializer)
            found += [a.t for node in g.node for a in node.attribute if a.HasField("t")]
        return found


def m_attr_value(m: Mutation) -> None:
    """Set an existing attribute's value to a boundary value of its own kind."""
    node = m.node()
    if node is None or not len(node.attribute):
        return m_attr_add(m)
    attr = node.attribute[m.rng.randrange(len(node.attribute))]
    rng = m.rng
    if attr.type == attr.INT:
        attr.i = pick_int(rng)
    elif attr.type == attr.FLOAT:
        attr.f = pick_float(rng)
    elif attr.type == attr.STRING:
        attr.s = pick_bytes(rng)
    elif attr.type == attr.INTS:
        values = list(attr.ints) or [0]
        values[rng.randrange(len(values))] = pick_int(rng)
        if rng.random() < 0.3:
            values = values * rng.choice([0, 2, 9])
        attr.ClearField("ints")
        attr.ints.extend(values)
    elif attr.type == attr.FLOATS:
        attr.floats.append(pick_float(rng))
    elif attr.type == attr.STRINGS:
        attr.strings.append(pick_bytes(rng))
    elif attr.type == attr.TENSOR:
        mutate_tensor(m, attr.t)
    elif attr.type == attr.GRAPH:
        attr.g.ClearField("output") if rng.random() < 0.5 else attr.g.ClearField("node")
    m.ops.append(f"attr_value:{attr.name}")


def m_attr_add(m: Mutation) -> None:
    """Add an attribute the op may or may not define, with a boundary value."""
    node = m.node()
    if node is None:
        return
    rng = m.rng
    attr = node.attribute.add()
    attr.name = rng.choice(ATTR_NAMES)
    kind = rng.choice(["int", "float", "string", "ints", "empty"])
    if kind == "int":
        attr.type, attr.i = attr.INT, pick_int(rng)
    elif kind == "float":
        attr.type, attr.f = attr.FLOAT, pick_float(rng)
    elif kind == "string":
        attr.type, attr.s = attr.STRING, pick_bytes(rng)
    elif kind == "ints":
        attr.type = attr.INTS
        attr.ints.extend(pick_int(rng) for _ in range(rng.randint(0, 4)))
    m.ops.append(f"attr_add:{attr.name}:{kind}")


def m_attr_type(m: Mutation) -> None:
    """Change an attribute's declared type (its value stays in the other field), or drop it."""
    node = m.node()
    if node is None or not len(node.attribute):
        return
    idx = m.rng.randrange(len(node.attribute))
    if m.rng.random() < 0.4:
        del node.attribute[idx]
        m.ops.append("attr_drop")
        return
    node.attribute[idx].type = m.rng.randint(0, 14)  # AttributeType is a closed enum
    m.ops.append("attr_type")


def m_dims(m: Mutation) -> None:
    """Change a declared dim (huge, negative, zero, symbolic) or a declared rank."""
    types = m.tensor_types()
    if not types:
        return
    tt = m.rng.choice(types)
    shape = tt.shape
    rng = m.rng
    if not len(shape.dim) or rng.random() < 0.2:
        if rng.random() < 0.5:
            shape.dim.add().dim_value = pick_int(rng)
        else:
            tt.ClearField("shape")
        m.ops.append("rank")
        return
    dim = shape.dim[rng.randrange(len(shape.dim))]
    if rng.random() < 0.75:
        dim.dim_value = pick_int(rng)
    else:
        dim.dim_param = rng.choice(["batch", "seq", "", "\u00e9", "N"])
    m.ops.append("dim")


def m_elem_type(m: Mutation) -> None:
    """Set an input's, output's or value_info's element type to any value, valid or not."""
    types = m.tensor_types()
    if types:
        m.rng.choice(types).elem_type = m.rng.choice([*range(0, 27), -1, 99, 2**31 - 1])
        m.ops.append("elem_type")


def m_rename(m: Mutation) -> None:
    """Point a node input or output at another name: an existing one, a dangling one, empty."""
    node = m.node()
    if node is None:
        return
    g = m.graph()
    field_ = node.input if (m.rng.random() < 0.6 and len(node.input)) else node.output
    if not len(field_):
        field_.append(m.value_name(g))
    else:
        field_[m.rng.randrange(len(field_))] = m.value_name(g)
    m.ops.append("rename")


def m_graph_io(m: Mutation) -> None:
    """Duplicate, drop or dangle a graph input or output."""
    g, rng = m.graph(), m.rng
    choice = rng.randrange(5)
    if choice == 0 and len(g.input):
        g.input.append(copy.deepcopy(g.input[rng.randrange(len(g.input))]))
    elif choice == 1 and len(g.input):
        del g.input[rng.randrange(len(g.input))]
    elif choice == 2 and len(g.output):
        g.output.append(copy.deepcopy(g.output[rng.randrange(len(g.output))]))
    elif choice == 3 and len(g.output):
        g.output[rng.randrange(len(g.output))].name = m.value_name(g)
    elif len(g.input):
        g.input[rng.randrange(len(g.input))].name = m.value_name(g)
    m.ops.append(f"graph_io:{choice}")


def m_op_type(m: Mutation) -> None:
    """Swap a node's op type for another known one, or its domain."""
    node = m.node()
    if node is None:
        return
    if m.rng.random() < 0.8:
        node.op_type = m.rng.choice(m.corpus.op_types)
    else:
        node.domain = m.rng.choice(DOMAINS)
    m.ops.append(f"op_type:{node.op_type}")


def m_opset(m: Mutation) -> None:
    """Change an opset version (or domain), add an opset import, or change ir_version."""
    rng, model = m.rng, m.model
    if rng.random() < 0.25:
        model.ir_version = rng.choice([0, 1, 3, 7, 10, 11, 12, 99, -1])
    elif len(model.opset_import) and rng.random() < 0.7:
        entry = model.opset_import[rng.randrange(len(model.opset_import))]
        entry.version = rng.choice([0, 1, 6, 11, 13, 17, 18, 21, 23, 25, 28, 1000000, -1, rng.randint(1, 30)])
    else:
        entry = model.opset_import.add()
        entry.domain, entry.version = rng.choice(DOMAINS), rng.randint(0, 30)
    m.ops.append("opset")


def m_nodes(m: Mutation) -> None:
    """Drop, duplicate or reorder nodes; graft a node from another seed."""
    g, rng = m.graph(), m.rng
    n = len(g.node)
    choice = rng.randrange(4)
    if choice == 0 and n:
        del g.node[rng.randrange(n)]
    elif choice == 1 and n:
        g.node.append(copy.deepcopy(g.node[rng.randrange(n)]))
    elif choice == 2 and n >= 2:
        i, j = rng.randrange(n), rng.randrange(n)
        a, b = copy.deepcopy(g.node[i]), copy.deepcopy(g.node[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
    else:
        donor = m.corpus.random_node(rng)
        if donor is not None:
            node = g.node.add()
            node.CopyFrom(donor)
            for k in range(len(node.input)):
                node.input[k] = m.value_name(g)
            if len(g.output) and len(node.output) and rng.random() < 0.5:
                node.output[0] = g.output[rng.randrange(len(g.output))].name
    m.ops.append(f"nodes:{choice}")


def mutate_tensor(m: Mutation, t: Any) -> None:
    """Make a tensor's dims, type, data or external-data fields disagree."""
    rng = m.rng
    choice = rng.randrange(6)
    if choice == 0:
        if len(t.dims) and rng.random() < 0.7:
            t.dims[rng.randrange(len(t.dims))] = pick_int(rng)
        else:
            t.dims.append(pick_int(rng))
    elif choice == 1:
        t.data_type = rng.choice([*range(0, 27), -1, 99])
    elif choice == 2 and t.raw_data:
        cut = rng.randrange(len(t.raw_data) + 1)
        t.raw_data = t.raw_data[:cut] if rng.random() < 0.6 else t.raw_data + bytes(rng.randint(1, 9))
    elif choice == 3:
        t.ClearField("raw_data")
        t.float_data.extend(pick_float(rng) for _ in range(rng.randint(0, 3)))
        t.int64_data.extend(pick_int(rng) for _ in range(rng.randint(0, 2)))
    elif choice == 4:
        t.data_location = 1  # EXTERNAL
        t.ClearField("raw_data")
        for key, value in (("location", rng.choice(EXTERNAL_LOCATIONS)), ("offset", str(pick_int(rng)))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        if rng.random() < 0.5:
            entry = t.external_data.add()
            entry.key, entry.value = rng.choice(["length", "checksum", "bogus"]), str(pick_int(rng))
    else:
        t.ClearField("dims")
    m.ops.append(f"tensor:{choice}")


def m_tensor(m: Mutation) -> None:
    """Mutate an initializer or a tensor attribute."""
    tensors = m.tensors()
    if tensors:
        mutate_tensor(m, m.rng.choice(tensors))


def m_value_info(m: Mutation) -> None:
    """Declare an intermediate value with a boundary dim or a wrong type."""
    g, rng = m.graph(), m.rng
    outs = [o for node in g.node for o in node.output]
    if not outs:
        return
    vi = g.value_info.add()
    vi.name = rng.choice(outs)
    tt = vi.type.tensor_type
    tt.elem_type = rng.choice([1, 7, 6, 9, 10, 11, rng.randint(0, 26)])
    for _ in range(rng.randint(0, 3)):
        tt.shape.dim.add().dim_value = pick_int(rng)
    m.ops.append("value_info")


PROTO_MUTATORS: list[tuple[Callable[[Mutation], None], int]] = [
    (m_attr_value, 5),
    (m_attr_add, 2),
    (m_attr_type, 1),
    (m_dims, 4),
    (m_elem_type, 3),
    (m_rename, 3),
    (m_graph_io, 2),
    (m_op_type, 2),
    (m_opset, 2),
    (m_nodes, 3),
    (m_tensor, 3),
    (m_value_info, 2),
]


def b_flip(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    for _ in range(rng.randint(1, 4)):
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return "flip"


def b_set(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    if data:
        data[rng.randrange(len(data))] = rng.choice([0x00, 0x01, 0x7F, 0x80, 0xFF, 0x08, 0x12, 0x1A, 0x22])
    return "set"


def b_insert(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    pos = rng.randrange(len(data) + 1)
    data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return "insert"


def b_delete(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    if data:
        pos = rng.randrange(len(data))
        del data[pos : pos + rng.randint(1, 16)]
    return "delete"


def b_truncate(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    del data[rng.randrange(len(data) + 1) :]
    return "truncate"


def b_splice(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    other = corpus.seeds[rng.randrange(len(corpus.seeds))][1]
    cut_a, cut_b = rng.randrange(len(data) + 1), rng.randrange(len(other) + 1)
    data[cut_a:] = other[cut_b:]
    return "splice"


def b_varint(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    """Overwrite a byte run with a huge varint: lengths and ints then point past the end."""
    if data:
        pos = rng.randrange(len(data))
        data[pos : pos + 1] = rng.choice(
            [b"\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x7f"]
        )
    return "varint"


def b_not_utf8(data: bytearray, rng: random.Random, corpus: Corpus) -> str:
    """Make one printable run (a name, an op type, an equation) invalid UTF-8, same length."""
    runs = [mt.start() for mt in re.finditer(rb"[A-Za-z_][A-Za-z0-9_.]{2,}", bytes(data[:65536]))]
    if runs:
        data[rng.choice(runs)] = 0xFF
    return "not_utf8"


BYTE_MUTATORS: list[tuple[Callable[[bytearray, random.Random, Corpus], str], int]] = [
    (b_flip, 3),
    (b_set, 2),
    (b_insert, 1),
    (b_delete, 1),
    (b_truncate, 1),
    (b_splice, 1),
    (b_varint, 1),
    (b_not_utf8, 2),
]


# How often a case starts from each kind of seed: the node suite's ~1,900 small models
# mostly; the known findings often (their neighbourhoods hide siblings); the fixtures
# rarely (each costs ~20 ms to compile where a node model costs ~1 ms).
SEED_WEIGHTS = {"node": 0.82, "repro": 0.10, "fixture": 0.03, "dir": 0.05}


class Corpus:
    """The seeds, parsed once per worker, and what the mutators draw from them."""

    def __init__(self, seeds: list[tuple[str, bytes]]) -> None:
        import onnx

        self.seeds = seeds
        self.parsed: list[Any] = []
        for _, data in seeds:
            proto = onnx.ModelProto()
            try:
                proto.ParseFromString(data)
            except Exception:  # noqa: BLE001  (a seed that is not a model: byte-level only)
                proto = None
            self.parsed.append(proto)
        self.op_types = sorted({n.op_type for p in self.parsed if p is not None for n in p.graph.node}) or ["Relu"]
        self._node_pool = [n for p in self.parsed if p is not None for n in p.graph.node]
        self._proto_ops = [f for f, w in PROTO_MUTATORS for _ in range(w)]
        self._byte_ops = [f for f, w in BYTE_MUTATORS for _ in range(w)]
        by_kind: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(seeds):
            by_kind.setdefault(name.split(":")[0], []).append(i)
        self._groups = list(by_kind.values())
        self._group_weights = [SEED_WEIGHTS.get(kind, 0.05) for kind in by_kind]

    def random_node(self, rng: random.Random) -> Any | None:
        return rng.choice(self._node_pool) if self._node_pool else None

    def case(self, seed: int, case_id: int) -> tuple[bytes, str, list[str]]:
        """Case ``case_id`` of run ``seed``: (its bytes, its seed's name, the mutations applied)."""
        rng = random.Random(f"{seed}:{case_id}")
        group = rng.choices(self._groups, self._group_weights)[0]
        index = group[rng.randrange(len(group))]
        name, raw = self.seeds[index]
        roll = rng.random()
        if roll < 0.02:
            return raw, name, ["none"]  # the seed itself: a baseline, and the repros as they are
        data, ops = self.mutate(raw, self.parsed[index], rng, roll)
        return data, name, ops

    def mutate(self, raw: bytes, proto: Any, rng: random.Random, roll: float | None = None) -> tuple[bytes, list[str]]:
        """``raw`` mutated: protobuf-level on ``proto`` (its parse, or None), then perhaps byte-level."""
        import onnx

        ops: list[str] = []
        roll = rng.random() if roll is None else roll
        if proto is not None and roll < 0.8:
            model = onnx.ModelProto()
            model.CopyFrom(proto)
            m = Mutation(model, rng, self)
            for _ in range(1 + int(rng.expovariate(1.0))):
                mutator = rng.choice(self._proto_ops)
                try:
                    mutator(m)
                except (ValueError, TypeError, IndexError) as exc:  # a value protobuf refuses
                    m.ops.append(f"{mutator.__name__}:refused:{type(exc).__name__}")
            ops = m.ops
            try:
                raw = model.SerializeToString()
            except Exception as exc:  # noqa: BLE001  (a mutation protobuf cannot encode)
                ops.append(f"unserializable:{type(exc).__name__}")
            if rng.random() > 0.15:
                return raw, ops
        data = bytearray(raw)
        for _ in range(1 + int(rng.expovariate(1.0))):
            ops.append(rng.choice(self._byte_ops)(data, rng, self))
        return bytes(data), ops


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------


class FeedError(Exception):
    """The harness cannot make feeds for this model (a dtype numpy lacks, a huge input)."""


class Mismatch(Exception):
    """model.run and model.run_legacy disagree."""


RANDOM_OPS = re.compile(rb"Random|Bernoulli|Multinomial|Dropout")  # outputs that differ run to run
MAX_FEED_ELEMENTS = 1 << 16


def make_feeds(model: Any, rng: Any) -> dict[str, Any]:
    """Small random feeds that match the model's declared inputs; symbolic dims are 1-3."""
    import numpy as np

    from dsp_core.ir import dtypes

    graph = model.graph
    feeds: dict[str, Any] = {}
    symbols: dict[str, int] = {}
    for v in graph.inputs:
        if v.name in graph.initializers:
            continue
        kind = getattr(v, "kind", "tensor")
        if kind != "tensor":
            feeds[v.name] = [] if kind == "sequence" else None
            continue
        if v.dtype is None or str(v.dtype).startswith("unsupported"):
            raise FeedError(f"input {v.name!r} has dtype {v.dtype}")
        try:
            dtype = np.dtype(dtypes.to_numpy(v.dtype))
        except Exception as exc:  # noqa: BLE001
            raise FeedError(f"no numpy dtype for {v.dtype}: {exc}") from exc
        shape = (
            [1]
            if v.shape is None
            else [symbols.setdefault(d, int(rng.integers(1, 4))) if not isinstance(d, int) else d for d in v.shape]
        )
        if any(d < 0 or d > MAX_FEED_ELEMENTS for d in shape) or math.prod(shape) > MAX_FEED_ELEMENTS:
            raise FeedError(f"input {v.name!r} shape {shape}")
        feeds[v.name] = random_array(dtype, shape, rng)
    return feeds


def random_array(dtype: Any, shape: list[int], rng: Any) -> Any:
    """Values a kernel meets in real models: small ints (indices stay in range), normal floats."""
    import numpy as np

    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 3, shape).astype(dtype)
    if dtype.kind in "US":
        return np.array(rng.choice(["a", "bc", ""], shape), dtype=dtype)
    if dtype.kind == "O":
        return np.array(rng.choice(["a", "bc", ""], shape), dtype=object)
    return rng.standard_normal(shape).astype(dtype)


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when two output dicts agree (dtype, shape, values with NaN = NaN), else how not."""
    import numpy as np

    if set(a) != set(b):
        return f"outputs {sorted(a)} vs {sorted(b)}"
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, list) or isinstance(y, list) or x is None or y is None:
            if type(x) is not type(y):
                return f"{name}: {type(x).__name__} vs {type(y).__name__}"
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if x.dtype.kind in "fc":
            # in chunks: a float64 copy of two big outputs must not be what hits the memory cap
            fx, fy = x.reshape(-1), y.reshape(-1)
            for at in range(0, fx.size, 1 << 20):
                cx, cy = fx[at : at + (1 << 20)].astype(np.float64), fy[at : at + (1 << 20)].astype(np.float64)
                with np.errstate(all="ignore"):
                    if not np.allclose(cx, cy, rtol=1e-4, atol=1e-6, equal_nan=True):
                        return f"{name}: values differ"
        elif x.dtype.kind != "V" and not np.array_equal(x, y):
            return f"{name}: values differ"
    return None


class DSPTarget:
    """dsp.compile(bytes); when it compiles, model.run and model.run_legacy on random feeds.

    ``FUZZ_RUNS`` (default 1): runs of ``model.run`` on the same feeds, each compared with
    the legacy interpreter's outputs; with ``DSP_FREEZE_AFTER=1`` and 4 runs a plan freezes,
    captures and replays, so a capturing mode (``DSP_MODE=numpy_replay``) is fuzzed too.
    """

    def __init__(self) -> None:
        import numpy as np

        import dsp_core
        from dsp_core.errors import DSPError

        self.dsp, self.np = dsp_core, np
        self.expected: tuple[type[BaseException], ...] = (DSPError,)
        self.harness: tuple[type[BaseException], ...] = (FeedError,)
        self.stage = "compile"
        self.runs = max(1, env_int("FUZZ_RUNS", 1))

    def __call__(self, data: bytes) -> str:
        self.stage = "compile"
        model = self.dsp.compile(data)
        self.stage = "feeds"
        try:
            feeds = make_feeds(model, self.np.random.default_rng(zlib.crc32(data)))
        except FeedError:
            return "compiled (no feeds)"
        self.stage = "run"
        outs = [model.run(feeds) for _ in range(self.runs)]
        self.stage = "legacy"
        ref = model.run_legacy(feeds)
        self.stage = "compare"
        if not RANDOM_OPS.search(data):  # the bytes, so subgraphs count too
            for k, got in enumerate(outs):
                diff = same_outputs(got, ref)
                if diff is not None:
                    raise Mismatch(diff if self.runs == 1 else f"run {k + 1}: {diff}")
        return "ran"


class FunctionTarget:
    """A plain function ``f(data: bytes)`` from a file: the module's EXPECTED are fine errors."""

    def __init__(self, func: Callable[[bytes], Any], expected: tuple[type[BaseException], ...]) -> None:
        self.func, self.expected, self.harness, self.stage = func, expected, (), "run"

    def __call__(self, data: bytes) -> str:
        result = self.func(data)
        return result if isinstance(result, str) else "ok"


def load_target(spec: str) -> Any:
    """``dsp`` (the default) or ``FILE.py:FUNCTION`` (the harness's own tests plant faults so)."""
    if spec == "dsp":
        return DSPTarget()
    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("fuzz_target", path)
    assert module_spec is not None and module_spec.loader is not None, f"cannot load target {spec}"
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["fuzz_target"] = module
    module_spec.loader.exec_module(module)
    return FunctionTarget(getattr(module, name), tuple(getattr(module, "EXPECTED", ())))


@dataclass
class Outcome:
    """What one case did: its class, its key for the table, a signature to group reproducers by."""

    cls: str
    key: str
    signature: str = ""
    detail: str = ""


def innermost_frame(tb: Any) -> str:
    """The innermost traceback frame in DSP's code (else the innermost of all), as file:line."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "dsp_core" in f.filename or "/plugins/" in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    parts = Path(frame.filename).parts
    short = "/".join(parts[-3:])
    return f"{short}:{frame.lineno}"


def run_case(target: Any, data: bytes) -> Outcome:
    """Run the target on one input and classify what happened."""
    try:
        status = target(data)
    except MemoryError as exc:
        return Outcome(
            BLOWUP,
            f"{target.stage}:MemoryError",
            f"MemoryError@{innermost_frame(exc.__traceback__)}",
            traceback.format_exc(),
        )
    except Mismatch as exc:
        return Outcome(MISMATCH, "compare:Mismatch", f"Mismatch:{str(exc).split(':')[-1].strip()}", str(exc))
    except BaseException as exc:  # noqa: BLE001  (SystemExit and KeyboardInterrupt from a target are findings too)
        if isinstance(exc, KeyboardInterrupt) and target.stage == "":
            raise
        name = type(exc).__name__
        if isinstance(exc, target.expected):
            return Outcome(DSP, f"{target.stage}:{name}")
        where = innermost_frame(exc.__traceback__)
        harness = isinstance(exc, target.harness) or target.stage in ("feeds", "compare")
        cls = HARNESS if harness else NONDSP
        qual = name if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{name}"
        return Outcome(cls, f"{target.stage}:{qual}", f"{qual}@{where}", traceback.format_exc())
    return Outcome(OK, status)


# --------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------


def vm_size_bytes() -> int:
    """This process's virtual size (what RLIMIT_AS counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def cap_memory(mem_mb: int) -> None:
    """RLIMIT_AS at the current virtual size plus ``mem_mb``: past it, allocations fail."""
    if mem_mb > 0:
        limit = vm_size_bytes() + mem_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def quiet() -> None:
    """No warnings or log lines per case: a million of them would fill the disk."""
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)


def slug(text: str, limit: int = 90) -> str:
    """A file-name-safe form of a signature."""
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", text)[:limit].strip("_") or "x"


def save_reproducer(out: Path, cls: str, case_id: int | str, data: bytes, text: str, signature: str) -> Path:
    """Write the input as ``out/<class dir>/<signature>-<id>.onnx`` and what is known beside it."""
    folder = out / REPRO_DIRS[cls]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{slug(signature)}-{case_id}.onnx"
    path.write_bytes(data)
    path.with_suffix(".txt").write_text(text)
    return path


def worker_main(args: argparse.Namespace) -> int:
    """Run cases ``start, start + jobs, ...`` and report each on the pipe; see the module doc."""
    quiet()
    out, work = Path(args.out), Path(args.work)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    target = load_target(args.target)
    corpus = Corpus(read_corpus(work / "seeds.bin"))
    cap_memory(args.mem_mb)
    cur = os.open(work / f"current-{args.worker_id}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    reporter = Reporter(args, out, cur, target)
    if args.engine == "atheris":
        return atheris_worker(args, corpus, reporter, work)
    case_id = args.start
    while args.stop < 0 or case_id < args.stop:
        data, seed_name, ops = corpus.case(args.seed, case_id)
        if reporter.run(case_id, data, seed_name, ",".join(ops)) == BLOWUP:
            return BLOWUP_EXIT
        case_id += args.jobs
    return 0


class Reporter:
    """One worker's side of the protocol: announce a case, run it, save a reproducer, report."""

    def __init__(self, args: argparse.Namespace, out: Path, cur: int, target: Any) -> None:
        self.args, self.out, self.cur, self.target = args, out, cur, target
        self.kept: Counter[str] = Counter()

    def run(self, case_id: int, data: bytes, seed_name: str, ops: str) -> str:
        """Run one case; returns its outcome class."""
        args, pipe = self.args, self.args.pipe_fd
        os.ftruncate(self.cur, 0)
        os.pwrite(self.cur, data, 0)
        os.write(pipe, f"C\t{case_id}\t{seed_name}\t{ops[:300]}\n".encode())
        t = time.monotonic()
        outcome = run_case(self.target, data)
        seconds = time.monotonic() - t
        path = ""
        if outcome.cls not in (OK, DSP) and self.kept[outcome.signature] < args.keep:
            self.kept[outcome.signature] += 1
            text = f"{outcome.cls} {outcome.key}\ncase {case_id} seed {args.seed} from {seed_name}: {ops}\n\n"
            path = str(save_reproducer(self.out, outcome.cls, case_id, data, text + outcome.detail, outcome.signature))
        sig = outcome.signature.replace("\t", " ").replace("\n", " ")
        os.write(pipe, f"R\t{case_id}\t{outcome.cls}\t{outcome.key}\t{sig}\t{path}\t{seconds:.3f}\n".encode())
        if case_id % 4096 < args.jobs and os.fstat(2).st_size > 4 << 20:
            os.ftruncate(2, 0)  # stray output of a million cases; the log matters only at a death
        return outcome.cls


def atheris_worker(args: argparse.Namespace, corpus: Corpus, reporter: Reporter, work: Path) -> int:
    """Coverage-guided: libFuzzer (through atheris) picks and keeps the inputs that reach new
    code of the instrumented DSP; mutations are half libFuzzer's byte-level ones, half this
    harness's protobuf-level ones. Cases are numbered as in the plain engine, but an input is
    not regenerated from its id (libFuzzer's choices depend on coverage): reproducers hold it."""
    import onnx

    try:
        import atheris  # type: ignore[import-not-found]
    except ImportError:
        print("fuzz: --engine atheris needs atheris (pip install -e '.[fuzz]')", file=sys.stderr)
        return 2
    seeds = work / f"atheris-seeds-{args.worker_id}"
    seeds.mkdir(exist_ok=True)
    for i, (_, data) in enumerate(corpus.seeds):
        (seeds / f"seed-{i:05d}").write_bytes(data)
    numbers = iter(range(args.start, sys.maxsize, args.jobs))
    origin = f"atheris:w{args.worker_id}"

    def one_input(data: bytes) -> None:
        case_id = next(numbers)
        if 0 <= args.stop <= case_id:
            os._exit(0)  # libFuzzer has no "stop after N": this worker's share is done
        if reporter.run(case_id, bytes(data), origin, "coverage-guided") == BLOWUP:
            os._exit(BLOWUP_EXIT)

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            return bytes(atheris.Mutate(data, max_size))
        proto: Any = onnx.ModelProto()
        try:
            proto.ParseFromString(data)
        except Exception:  # noqa: BLE001  (not a model: byte-level mutators only)
            proto = None
        return corpus.mutate(bytes(data), proto, rng)[0][:max_size]

    atheris.instrument_all()  # every loaded Python module, DSP's included, reports its coverage
    flags = [sys.argv[0], str(seeds), f"-seed={args.seed * 1000 + args.worker_id + 1}", "-rss_limit_mb=0"]
    flags += ["-timeout=0", "-max_len=4194304", "-print_final_stats=0"]
    atheris.Setup(flags, one_input, custom_mutator=mutate)
    atheris.Fuzz()
    return 0


# --------------------------------------------------------------------------------------
# Supervisor
# --------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One worker process as the supervisor sees it."""

    wid: int
    next_case: int
    proc: subprocess.Popen[bytes] | None = None
    fd: int = -1
    buf: bytes = b""
    current: tuple[int, float, str] | None = None  # case id, when announced, seed + mutations
    done: bool = False
    starts_without_case: int = 0


@dataclass
class Tally:
    """Counts by outcome key and class, and reproducers grouped by signature."""

    keys: Counter[str] = field(default_factory=Counter)
    classes: Counter[str] = field(default_factory=Counter)
    signatures: dict[str, dict[str, Any]] = field(default_factory=dict)
    restarts: int = 0
    slowest: list[tuple[float, int, str, str]] = field(default_factory=list)  # seconds, case, outcome, what

    def add_time(self, seconds: float, case_id: int, outcome: str, what: str) -> None:
        """Keep the ten slowest cases that finished: near-hangs the timeout does not count."""
        if len(self.slowest) < 10 or seconds > self.slowest[-1][0]:
            self.slowest = sorted([*self.slowest, (seconds, case_id, outcome, what)], reverse=True)[:10]

    @property
    def inputs(self) -> int:
        return sum(self.classes.values())

    def add(self, cls: str, key: str, signature: str = "", path: str = "") -> None:
        self.keys[f"{cls}\t{key}"] += 1
        self.classes[cls] += 1
        if cls not in (OK, DSP):
            entry = self.signatures.setdefault(f"{cls}\t{signature}", {"count": 0, "reproducers": []})
            entry["count"] += 1
            if path:
                entry["reproducers"].append(path)


class Supervisor:
    """Starts workers, watches their pipes and clocks, saves the inputs of those that die."""

    def __init__(self, args: argparse.Namespace, out: Path, work: Path) -> None:
        self.args, self.out, self.work = args, out, work
        self.tally = Tally()
        self.workers = [Worker(w, w) for w in range(args.jobs)]
        self.kept: Counter[str] = Counter()
        self.t0 = time.monotonic()

    def spawn(self, w: Worker) -> None:
        read_fd, write_fd = os.pipe()
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--pipe-fd", str(write_fd)]
        cmd += ["--worker-id", str(w.wid), "--start", str(w.next_case), "--stop", str(a.cases if a.cases else -1)]
        cmd += ["--jobs", str(a.jobs), "--seed", str(a.seed), "--mem-mb", str(a.mem_mb), "--keep", str(a.keep)]
        cmd += ["--out", str(self.out), "--work", str(self.work), "--target", a.target, "--engine", a.engine]
        cache = self.work / f"cache-{w.wid}"
        cache.mkdir(exist_ok=True)
        env = dict(os.environ, DSP_DISK_CACHE="0", DSP_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        # DSP's own bounds, set well inside the case timeout: a model that reaches one of
        # them must get its DSPError, not be counted as a hang (the caller's values win)
        for name, value in FUZZ_BOUNDS.items():
            env.setdefault(name, value)
        log = open(self.work / f"worker-{w.wid}.log", "wb")  # noqa: SIM115  (the child owns it)
        w.proc = subprocess.Popen(
            cmd,
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            cwd=cache,
            start_new_session=True,
        )
        log.close()
        os.close(write_fd)
        w.fd, w.buf, w.current = read_fd, b"", None
        w.current = (-1, time.monotonic(), "start")  # startup counts against a (longer) clock too

    def on_line(self, w: Worker, line: str) -> None:
        parts = line.split("\t")
        if parts[0] == "C":
            w.current = (int(parts[1]), time.monotonic(), f"{parts[2]}: {parts[3]}")
            w.starts_without_case = 0
        elif parts[0] == "R":
            case_id, cls, key, sig, path = int(parts[1]), parts[2], parts[3], parts[4], parts[5]
            self.tally.add(cls, key, sig, path)
            if w.current is not None and float(parts[6]) > 0.5:
                self.tally.add_time(float(parts[6]), case_id, f"{cls} {key}", w.current[2])
            w.current = None
            w.next_case = case_id + self.args.jobs

    def read(self, w: Worker) -> bool:
        """Read what a worker wrote; False at end of file (it exited)."""
        chunk = os.read(w.fd, 1 << 16)
        if not chunk:
            return False
        w.buf += chunk
        *lines, w.buf = w.buf.split(b"\n")
        for line in lines:
            self.on_line(w, line.decode(errors="replace"))
        return True

    def fault_text(self, w: Worker) -> str:
        """The tail of a worker's stderr: faulthandler's traceback, a C++ terminate message."""
        try:
            with open(self.work / f"worker-{w.wid}.log", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def fault_signature(self, text: str) -> str:
        """Where the dying (or stuck) thread was: the innermost frame of faulthandler's last dump."""
        start = text.rfind("Current thread")
        if start < 0:
            return "?" if "bad_alloc" not in text else "std::bad_alloc"
        block = text[start:].split("\n\n")[0]
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        if not frames:
            return "?"
        path, line, func = frames[0]  # faulthandler prints the innermost frame first
        return f"{'/'.join(Path(path).parts[-3:])}:{line}:{func}"

    def record_death(self, w: Worker, cls: str, key: str, text: str) -> None:
        """Count the case a worker died on and save its input, which is in its current file."""
        assert w.current is not None
        case_id, _, what = w.current
        signature = f"{key}@{self.fault_signature(text)}"
        path = ""
        if case_id >= 0 and self.kept[signature] < self.args.keep:
            self.kept[signature] += 1
            data = (self.work / f"current-{w.wid}").read_bytes()
            info = f"{cls} {key}\ncase {case_id} seed {self.args.seed} from {what}\n\n{text[-8000:]}"
            path = str(save_reproducer(self.out, cls, case_id, data, info, signature))
        if case_id >= 0:
            self.tally.add(cls, key, signature, path)
            w.next_case = case_id + self.args.jobs
        w.current = None

    def record_libfuzzer_exit(self, w: Worker, text: str) -> None:
        """libFuzzer ended a worker (its exit code): a deadly signal, or its own view of an
        allocation that fails under the cap. Replay the input in a plain process: that decides."""
        assert w.current is not None
        data = (self.work / f"current-{w.wid}").read_bytes()
        probe = self.work / f"libfuzzer-exit-{w.wid}.onnx"
        probe.write_bytes(data)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--replay", str(probe), "--target", self.args.target]
        cmd += ["--mem-mb", str(self.args.mem_mb)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), **{k: os.environ.get(k, v) for k, v in FUZZ_BOUNDS.items()})
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.timeout + 30, env=env)
        except subprocess.TimeoutExpired:
            self.record_death(w, HANG, "timeout", text + "\n(libFuzzer exit; the plain replay timed out)")
            return
        if done.returncode < 0:
            sig = signal.Signals(-done.returncode).name
            self.record_death(w, CRASH, f"signal:{sig}", text + "\n(libFuzzer exit; the plain replay died too)")
            return
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith(str(probe))), "")
        cls, key = (line.split(": ", 1)[1].split()[:2] + ["?", "?"])[:2] if line else (CRASH, f"exit:{LIBFUZZER_EXIT}")
        if cls in (OK, DSP):  # fine in a plain process: libFuzzer's environment ended it, not DSP
            case_id = w.current[0]
            self.tally.add(cls, key, f"{key}@libfuzzer-exit", "")
            w.next_case = case_id + self.args.jobs
            w.current = None
            return
        self.record_death(w, cls, key, text + f"\n(libFuzzer exit; the plain replay: {line})")

    def on_exit(self, w: Worker) -> None:
        """A worker exited: classify the case it was in, if any, and start it again."""
        assert w.proc is not None
        rc = w.proc.wait()
        os.close(w.fd)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGKILL)  # what it started (DSP's inference sandbox) goes too
        text = self.fault_text(w)
        if w.current is not None and w.current[0] >= 0:
            if rc < 0:
                sig = signal.Signals(-rc).name
                blowup = "bad_alloc" in text or "MemoryError" in text or rc == -signal.SIGKILL
                self.record_death(w, BLOWUP if blowup else CRASH, f"signal:{sig}", text)
            elif self.args.engine == "atheris" and rc == LIBFUZZER_EXIT:
                self.record_libfuzzer_exit(w, text)
            else:
                self.record_death(w, CRASH, f"exit:{rc}", text)
        elif rc == 0:
            w.done = True
            return
        elif rc != BLOWUP_EXIT:
            w.starts_without_case += 1
            if w.starts_without_case >= 3:
                raise SystemExit(f"fuzz: worker {w.wid} fails to start (exit {rc}):\n{text[-4000:]}")
        self.tally.restarts += 1
        self.spawn(w)

    def kill_hung(self, w: Worker, now: float) -> None:
        """Past the case timeout: dump its stacks (SIGUSR1, faulthandler), kill it, save the input."""
        assert w.proc is not None and w.current is not None
        try:
            w.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
            os.killpg(w.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        w.proc.wait()
        while self.read(w):  # results it wrote before the kill (the case may have just ended)
            pass
        if w.current is not None:
            if w.current[0] < 0:
                raise SystemExit(f"fuzz: worker {w.wid} did not start in time:\n{self.fault_text(w)[-4000:]}")
            self.record_death(w, HANG, "timeout", self.fault_text(w))
        os.close(w.fd)
        self.tally.restarts += 1
        self.spawn(w)

    def progress(self, final: bool = False) -> str:
        t = time.monotonic() - self.t0
        c = self.tally.classes
        line = f"[{t:6.0f}s] {self.tally.inputs:>10,} inputs {self.tally.inputs / max(t, 1e-9):7.0f}/s"
        for cls in CLASSES:
            if c[cls] or cls in (OK, DSP) + FAILURES:
                line += f"  {cls} {c[cls]:,}"
        return line + f"  restarts {self.tally.restarts}" + ("  (done)" if final else "")

    def run(self) -> None:
        a = self.args
        for w in self.workers:
            self.spawn(w)
        last = time.monotonic()
        while True:
            live = [w for w in self.workers if not w.done]
            if not live:
                break
            now = time.monotonic()
            if a.time and now - self.t0 >= a.time:
                break
            ready, _, _ = select.select([w.fd for w in live], [], [], 0.2)
            for w in live:
                if w.fd in ready and not self.read(w):
                    self.on_exit(w)
            now = time.monotonic()
            for w in live:
                if w.current is not None and not w.done:
                    limit = a.startup_timeout if w.current[0] < 0 else a.timeout
                    if now - w.current[1] > limit:
                        self.kill_hung(w, now)
            if now - last >= a.progress:
                print(self.progress(), flush=True)
                last = now
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGKILL)
                w.proc.wait()

    def report(self, seeds: int) -> dict[str, Any]:
        elapsed = time.monotonic() - self.t0
        t = self.tally
        failures = {cls: t.classes[cls] for cls in FAILURES}
        return {
            "inputs": t.inputs,
            "seconds": round(elapsed, 1),
            "rate_per_s": round(t.inputs / max(elapsed, 1e-9), 1),
            "jobs": self.args.jobs,
            "seed": self.args.seed,
            "seeds_in_corpus": seeds,
            "timeout_s": self.args.timeout,
            "mem_mb": self.args.mem_mb,
            "classes": {cls: t.classes[cls] for cls in CLASSES},
            "failures": failures,
            "outcomes": {k.replace("\t", " "): n for k, n in t.keys.most_common()},
            "signatures": {k.replace("\t", " "): v for k, v in sorted(t.signatures.items())},
            "restarts": t.restarts,
            "slowest": [{"seconds": round(s, 2), "case": c, "outcome": o, "from": what} for s, c, o, what in t.slowest],
        }


def print_report(summary: dict[str, Any], out: Path) -> None:
    """The outcome table, the failure classes with example reproducers, where the JSON is."""
    print(
        f"\n{summary['inputs']:,} inputs in {summary['seconds']} s ({summary['rate_per_s']}/s, "
        f"{summary['jobs']} workers, seed {summary['seed']}, {summary['seeds_in_corpus']} seeds)"
    )
    print(f"\n{'class':9s} {'count':>10s}  outcome")
    for key, n in summary["outcomes"].items():
        cls, _, what = key.partition(" ")
        print(f"{cls:9s} {n:>10,}  {what}")
    print("\nfailures: " + ", ".join(f"{cls} {n:,}" for cls, n in summary["failures"].items()))
    for key, entry in summary["signatures"].items():
        cls = key.split(" ")[0]
        if cls in (HARNESS,) or not entry["count"]:
            continue
        example = entry["reproducers"][0] if entry["reproducers"] else "(not kept)"
        print(f"  {entry['count']:>8,}  {key}\n            {example}")
    if summary["slowest"]:
        print("\nslowest cases that finished (regenerate one: --seed S --regen CASE):")
        for entry in summary["slowest"][:5]:
            print(f"  {entry['seconds']:7.2f} s  case {entry['case']}  {entry['outcome']}  {entry['from'][:90]}")
    print(f"\nsummary: {out / 'summary.json'}")


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


LIBFUZZER_EXIT = 77  # libFuzzer's -error_exitcode: how it ends a worker it judged crashed

FUZZ_BOUNDS = {
    "DSP_SHAPE_INFERENCE_TIMEOUT": "2",
    "DSP_MAX_LOOP_ITERATIONS": "100000",
}


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value.strip() else default


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--time",
        type=float,
        default=None,
        help="seconds to run (FUZZ_TIME; default 120, or no limit when --cases is given; 0: no limit)",
    )
    p.add_argument("--cases", type=int, default=env_int("FUZZ_CASES", 0), help="stop after N inputs (FUZZ_CASES)")
    p.add_argument("--jobs", type=int, default=env_int("FUZZ_JOBS", 2), help="worker processes (FUZZ_JOBS)")
    p.add_argument(
        "--mem-mb",
        type=int,
        default=env_int("FUZZ_MEM_MB", 2048),
        help="RLIMIT_AS above a worker's baseline, MiB (FUZZ_MEM_MB)",
    )
    p.add_argument(
        "--timeout", type=float, default=env_float("FUZZ_TIMEOUT", 30), help="seconds per case (FUZZ_TIMEOUT)"
    )
    p.add_argument("--seed", type=int, default=env_int("FUZZ_SEED", 0), help="run seed (FUZZ_SEED)")
    p.add_argument("--out", default=os.environ.get("FUZZ_OUT") or "fuzz-out", help="output folder (FUZZ_OUT)")
    p.add_argument("--keep", type=int, default=5, help="reproducers kept per failure signature (per worker)")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds a worker may take to start")
    p.add_argument("--max-seed-kb", type=int, default=4096, help="skip fixtures larger than this")
    p.add_argument("--seed-dir", action="append", default=[], help="extra seeds: every file of DIR")
    p.add_argument("--no-default-seeds", action="store_true", help="only the --seed-dir seeds")
    p.add_argument("--target", default="dsp", help="dsp, or FILE.py:FUNCTION (a test target)")
    p.add_argument("--fail-on-mismatch", action="store_true", help="run/run_legacy disagreeing fails too")
    p.add_argument(
        "--engine",
        choices=("mutate", "atheris"),
        default=os.environ.get("FUZZ_ENGINE") or "mutate",
        help="mutate: seeded mutations, each input regenerated from its id; atheris: coverage-guided (FUZZ_ENGINE)",
    )
    p.add_argument("--replay", nargs="+", metavar="FILE", help="run the target on these inputs in-process")
    p.add_argument("--regen", type=int, metavar="ID", help="write the input of case ID of --seed to --out/case-ID.onnx")
    # internal: how the supervisor starts a worker
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pipe-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.time is None:
        args.time = env_float("FUZZ_TIME", 0 if args.cases else 120)
    if args.time == 0 and args.cases == 0 and not (args.replay or args.worker or args.regen is not None):
        p.error("give --time or --cases (FUZZ_TIME, FUZZ_CASES): it would run for ever")
    return args


def replay_main(args: argparse.Namespace) -> int:
    """Run each file through the target in this process and print its outcome."""
    os.environ.setdefault("DSP_DISK_CACHE", "0")
    os.environ.setdefault("DSP_CACHE_DIR", tempfile.mkdtemp(prefix="dsp-fuzz-replay-"))
    quiet()
    faulthandler.enable()
    target = load_target(args.target)
    cap_memory(args.mem_mb)
    failed = 0
    for name in args.replay:
        t = time.monotonic()
        outcome = run_case(target, Path(name).read_bytes())
        print(f"{name}: {outcome.cls} {outcome.key} {outcome.signature} ({time.monotonic() - t:.2f} s)", flush=True)
        if outcome.detail:
            print(outcome.detail)
        failed += outcome.cls in FAILURES or (args.fail_on_mismatch and outcome.cls == MISMATCH)
    return 1 if failed else 0


def corpus_for(args: argparse.Namespace, work: Path) -> list[tuple[str, bytes]]:
    t = time.monotonic()
    seeds = build_corpus(args)
    if not seeds:
        raise SystemExit("fuzz: the seed corpus is empty")
    write_corpus(work / "seeds.bin", seeds)
    print(
        f"fuzz: {len(seeds)} seeds ({sum(len(d) for _, d in seeds) / 2**20:.1f} MiB) in {time.monotonic() - t:.1f} s",
        flush=True,
    )
    return seeds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        os.set_blocking(args.pipe_fd, True)
        return worker_main(args)
    if args.replay:
        return replay_main(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out / ".work"
    work.mkdir(exist_ok=True)
    if args.regen is not None:
        quiet()
        data, seed_name, ops = Corpus(build_corpus(args)).case(args.seed, args.regen)
        path = out / f"case-{args.regen}.onnx"
        path.write_bytes(data)
        print(f"{path}: from {seed_name}, {ops}")
        return 0
    seeds = corpus_for(args, work)
    print(
        f"fuzz: {args.jobs} workers, {args.time or 'no'} s limit, {args.cases or 'no'} case limit, "
        f"{args.timeout} s per case, {args.mem_mb} MiB cap, seed {args.seed}, out {out}",
        flush=True,
    )
    sup = Supervisor(args, out, work)
    try:
        sup.run()
    except KeyboardInterrupt:
        print("fuzz: interrupted", flush=True)
    finally:
        for w in sup.workers:
            if w.proc is not None and w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGKILL)
    print(sup.progress(final=True), flush=True)
    summary = sup.report(len(seeds))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_report(summary, out)
    failed = any(summary["failures"].values()) or (args.fail_on_mismatch and summary["classes"][MISMATCH])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
