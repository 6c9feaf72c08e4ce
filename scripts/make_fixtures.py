#!/usr/bin/env python
"""Generate the committed ONNX test fixtures and their torch golden data.

Run with the separate fixture venv (it needs torch, transformers, onnx,
onnxscript, onnxruntime; none of these is a project dependency):

    python3 -m venv .fixture-venv
    .fixture-venv/bin/pip install torch==2.13.0 transformers onnx==1.23.2 \
        onnxscript onnxruntime==1.32.0 numpy
    .fixture-venv/bin/python scripts/make_fixtures.py --out tests/fixtures

What it writes (see tests/fixtures/README.md for the npz key layout):

* four tiny decoders with a KV cache, random weights (GPT-2 and Llama, each
  with eager attention at opset 18 and with sdpa attention at opset 23), and
  the same GPT-2 exported by torch's TorchScript (legacy) exporter at opset 17
  (``gpt2_torchscript``), each with ``<name>.golden.npz``: a 7-token prefill plus 4 greedy decode steps
  (exact feeds and torch outputs), 32 greedy tokens and a batch-2 prefill;
* ``cnn.onnx`` (opset 17) with ``cnn.golden.npz``;
* ``external_data/mlp.onnx`` + ``external_data/mlp.onnx.data`` with
  ``external_data/mlp.golden.npz``.

Every exported model is run by onnxruntime (and by onnx's ReferenceEvaluator)
on every golden feed and compared with torch; the script fails loudly when the
max abs difference exceeds ``--tol`` (1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.reference
import onnxruntime as ort
import torch
import transformers
from decoder_export import (  # scripts/decoder_export.py: the recipe decode_gpu.py uses too
    DecoderWrapper,
    export_decoder_program,
    input_names,
    kv_dims,
    output_names,
    trace_inputs,
)
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

PROMPT = [17, 402, 93, 958, 5, 311, 640]  # fixed 7-token prompt (vocab 1000)
N_DECODE_STEPS = 4  # golden decode steps after the prefill (steps 1..4)
N_GREEDY = 32  # greedy tokens generated for pipeline tests
BATCH2_PROMPTS = [  # right-padded batch-2 prefill: lengths 7 and 5
    [17, 402, 93, 958, 5, 311, 640],
    [250, 8, 731, 64, 999],
]
PAD_ID = 0
VOCAB = 1000
# With the default init (std 0.02) the blocks barely touch the residual stream
# and greedy decoding with tied embeddings repeats the last prompt token
# forever. std 0.3 gives varied greedy tokens with clear top-1/top-2 margins.
INIT_RANGE = 0.3
MIN_MARGIN = 1e-3  # fail if a greedy choice is closer than this to a tie

# Versions the committed fixtures were made with (tests/fixtures/README.md).
# Other versions may export different graphs; the script warns, then goes on.
PINNED = {
    "torch": "2.13.0+cpu",
    "transformers": "5.24.0",
    "onnx": "1.23.2",
    "onnxscript": "0.7.2",
    "onnxruntime": "1.32.0",
    "numpy": "2.4.6",
}

# Files of the fixture folder this script does not write (left out of report.json's sizes).
NOT_MADE_HERE = ("report.json", "README.md", "tokenizer.json")

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- #
# Decoder models
# --------------------------------------------------------------------------- #


def build_gpt2(attn: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=128,
        n_inner=128,
        initializer_range=INIT_RANGE,
        bos_token_id=None,  # the GPT-2 default 50256 lies outside vocab 1000
        eos_token_id=None,
        attn_implementation=attn,
    )
    return GPT2LMHeadModel(cfg).eval()


def build_llama(attn: str) -> torch.nn.Module:
    torch.manual_seed(5678)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=True,  # keeps the .onnx small
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).eval()


def empty_past(model, batch: int) -> list[torch.Tensor]:
    n_layers, kv_heads, head_dim = kv_dims(model)
    return [torch.zeros(batch, kv_heads, 0, head_dim) for _ in range(2 * n_layers)]


def export_decoder(wrapper: DecoderWrapper, opset: int, path: Path) -> onnx.ModelProto:
    """The dynamo export (scripts/decoder_export.py's recipe), saved with its weights inline."""
    prog = export_decoder_program(wrapper, opset, external_data=False)
    model = prog.model_proto
    save_inline(model, path)
    return onnx.load(str(path))


def export_decoder_torchscript(wrapper: DecoderWrapper, opset: int, path: Path) -> onnx.ModelProto:
    """Export with torch's TorchScript (legacy) exporter, as ``torch.onnx.export(dynamo=False)`` users do.

    Default settings (constant folding on), ``dynamic_axes`` on batch, seq, past and
    total. The graph differs from the dynamo export: Constant nodes, ``/name/Op_N``
    names, a transposed copy of the tied ``lm_head`` weight, and layer 0's past key
    read through a one-input ``Concat`` before its growth Concat (issue 17 item 7).
    """
    n_layers = kv_dims(wrapper.model)[0]
    ids, mask, pos, past = trace_inputs(wrapper.model)  # the same trace inputs as export_decoder
    ins, outs = input_names(n_layers), output_names(n_layers)
    dyn: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch", 1: "seq"},
    }
    dyn.update({name: {0: "batch", 2: "past"} for name in ins[3:]})
    dyn.update({name: {0: "batch", 2: "total"} for name in outs[1:]})
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of the legacy exporter
        torch.onnx.export(
            wrapper,
            (ids, mask, pos, past),
            str(tmp),
            input_names=ins,
            output_names=outs,
            dynamic_axes=dyn,
            opset_version=opset,
            dynamo=False,
        )
    proto = onnx.load(str(tmp))
    tmp.unlink()
    save_inline(proto, path)
    return onnx.load(str(path))


# --------------------------------------------------------------------------- #
# Saving / checking helpers
# --------------------------------------------------------------------------- #


def strip_metadata(model: onnx.ModelProto) -> None:
    """Drop per-node exporter metadata (stack traces, module names): it is a
    third of the file and only noise for the tests."""

    def walk(graph):
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(model.graph)
    for fn in model.functions:
        for node in fn.node:
            del node.metadata_props[:]


def save_inline(model: onnx.ModelProto, path: Path) -> None:
    """Save with every initializer inside the .onnx (no external data)."""
    strip_metadata(model)
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise RuntimeError(f"{path.name}: initializer {init.name} is external")
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=False)
    onnx.checker.check_model(str(path), full_check=True)


def op_types(model: onnx.ModelProto) -> list[str]:
    ops = set()

    def walk(graph):
        for node in graph.node:
            ops.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}")
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(model.graph)
    for fn in model.functions:  # local functions, if any
        for node in fn.node:
            ops.add(node.op_type)
    return sorted(ops)


def opset_of(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


class Checker:
    """Runs a saved model with onnxruntime and the onnx ReferenceEvaluator."""

    def __init__(self, path: Path):
        self.path = path
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.ort_error = None
        try:
            self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - reported, then reference is used
            self.sess = None
            self.ort_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            log(f"  onnxruntime cannot load {path.name}: {self.ort_error}")
        self.ref = onnx.reference.ReferenceEvaluator(str(path))
        self.out_names = [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
        self.max_diff = {"ort": 0.0, "reference": 0.0}

    def check(self, feeds: dict[str, np.ndarray], expected: dict[str, np.ndarray], tol: float, what: str):
        runners = []
        if self.sess is not None:
            runners.append(("ort", lambda: self.sess.run(self.out_names, feeds)))
        runners.append(("reference", lambda: self.ref.run(self.out_names, feeds)))
        for tag, run in runners:
            outs = dict(zip(self.out_names, run()))
            worst = 0.0
            for name, exp in expected.items():
                got = outs[name]
                if got.shape != exp.shape:
                    raise AssertionError(
                        f"{self.path.name} [{tag}] {what} {name}: shape {got.shape} != torch {exp.shape}"
                    )
                d = float(np.max(np.abs(got.astype(np.float64) - exp))) if exp.size else 0.0
                worst = max(worst, d)
            self.max_diff[tag] = max(self.max_diff[tag], worst)
            if not worst < tol:
                raise AssertionError(f"{self.path.name} [{tag}] {what}: max abs diff {worst:.3g} >= {tol}")

    def greedy(self, prompt: np.ndarray, n: int, model) -> list[int]:
        """Greedy decoding through the onnx model (ort, else the reference)."""
        n_layers, kv_heads, head_dim = kv_dims(model)
        names = input_names(n_layers)
        run = (lambda f: self.sess.run(self.out_names, f)) if self.sess else (lambda f: self.ref.run(self.out_names, f))
        ids = prompt.astype(np.int64)
        past = [np.zeros((1, kv_heads, 0, head_dim), np.float32) for _ in range(2 * n_layers)]
        total, tokens = 0, []
        for _ in range(n):
            seq = ids.shape[1]
            mask = np.ones((1, total + seq), np.int64)
            pos = np.arange(total, total + seq, dtype=np.int64)[None]
            outs = run(dict(zip(names, [ids, mask, pos, *past])))
            total += seq
            ids = outs[0][:, -1:, :].argmax(-1).astype(np.int64)
            past = outs[1:]
            tokens.append(int(ids[0, 0]))
        return tokens


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


# --------------------------------------------------------------------------- #
# Golden data for decoders
# --------------------------------------------------------------------------- #


def run_torch(wrapper, ids, mask, pos, past):
    with torch.no_grad():
        return [t.detach().clone() for t in wrapper(ids, mask, pos, past)]


def decoder_goldens(wrapper: DecoderWrapper) -> tuple[dict[str, np.ndarray], list[tuple[str, dict, dict]]]:
    """Returns (npz arrays, list of (label, feeds, expected outputs))."""
    n_layers, _, _ = kv_dims(wrapper.model)
    in_names, out_names = input_names(n_layers), output_names(n_layers)
    data: dict[str, np.ndarray] = {"prompt": np.array([PROMPT], dtype=np.int64)}
    cases = []

    # (a) prefill (step0) + N_DECODE_STEPS greedy steps, batch 1
    ids = torch.tensor([PROMPT], dtype=torch.int64)
    past = empty_past(wrapper.model, 1)
    total = 0
    for k in range(N_DECODE_STEPS + 1):
        seq = ids.shape[1]
        mask = torch.ones(1, total + seq, dtype=torch.int64)
        pos = torch.arange(total, total + seq, dtype=torch.int64).unsqueeze(0)
        outs = run_torch(wrapper, ids, mask, pos, past)
        feeds = dict(zip(in_names, [to_np(ids), to_np(mask), to_np(pos)] + [to_np(p) for p in past]))
        expected = dict(zip(out_names, [to_np(o) for o in outs]))
        for name, arr in {**feeds, **expected}.items():
            data[f"step{k}.{name}"] = arr
        cases.append((f"step{k}", feeds, expected))
        total += seq
        ids = outs[0][:, -1, :].argmax(-1, keepdim=True)
        past = outs[1:]

    # (b) 32 greedy tokens from the prompt (same loop, no goldens per step)
    ids = torch.tensor([PROMPT], dtype=torch.int64)
    past = empty_past(wrapper.model, 1)
    total, tokens, margins = 0, [], []
    for _ in range(N_GREEDY):
        seq = ids.shape[1]
        mask = torch.ones(1, total + seq, dtype=torch.int64)
        pos = torch.arange(total, total + seq, dtype=torch.int64).unsqueeze(0)
        outs = run_torch(wrapper, ids, mask, pos, past)
        total += seq
        top2 = outs[0][0, -1, :].topk(2).values
        margins.append(float(top2[0] - top2[1]))
        ids = outs[0][:, -1, :].argmax(-1, keepdim=True)
        past = outs[1:]
        tokens.append(int(ids))
    # A near-tie would make greedy_tokens fragile against float noise.
    if min(margins) < MIN_MARGIN:
        raise AssertionError(f"greedy top-1/top-2 margin {min(margins):.3g} < {MIN_MARGIN}: pick other seeds")
    data["greedy_tokens"] = np.array(tokens, dtype=np.int64)
    data["greedy_min_margin"] = np.array(min(margins), dtype=np.float32)
    steps_tokens = [int(data[f"step{k}.input_ids"][0, 0]) for k in range(1, N_DECODE_STEPS + 1)]
    assert steps_tokens == tokens[:N_DECODE_STEPS], (steps_tokens, tokens[:N_DECODE_STEPS])

    # (c) batch-2 prefill, right padding (row 1 has 5 real tokens + 2 pads)
    width = max(len(p) for p in BATCH2_PROMPTS)
    ids = torch.full((2, width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros(2, width, dtype=torch.int64)
    for r, p in enumerate(BATCH2_PROMPTS):
        ids[r, : len(p)] = torch.tensor(p)
        mask[r, : len(p)] = 1
    pos = torch.arange(width, dtype=torch.int64).unsqueeze(0).repeat(2, 1)
    past = empty_past(wrapper.model, 2)
    outs = run_torch(wrapper, ids, mask, pos, past)
    feeds = dict(zip(in_names, [to_np(ids), to_np(mask), to_np(pos)] + [to_np(p) for p in past]))
    expected = dict(zip(out_names, [to_np(o) for o in outs]))
    for name, arr in {**feeds, **expected}.items():
        data[f"batch2.{name}"] = arr
    data["batch2.lengths"] = np.array([len(p) for p in BATCH2_PROMPTS], dtype=np.int64)
    cases.append(("batch2", feeds, expected))
    return data, cases


def check_batch2_rows(data: dict[str, np.ndarray], tol: float) -> float:
    """Real tokens of a right-padded row must match the same row run alone."""
    # row 0 is unpadded and equals the step0 prompt
    d = float(np.max(np.abs(data["batch2.logits"][0] - data["step0.logits"][0])))
    if not d < tol:
        raise AssertionError(f"batch2 row 0 differs from the batch-1 prefill by {d:.3g}")
    return d


# --------------------------------------------------------------------------- #
# CNN and MLP
# --------------------------------------------------------------------------- #


class SmallCNN(torch.nn.Module):
    """ResNet-ish: conv-bn-relu-maxpool, one residual block, strided conv,
    avgpool, global avgpool, flatten, linear."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(2)  # 32 -> 16
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())  # 16 -> 8
        self.avg = nn.AvgPool2d(2)  # 8 -> 4
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.pool(self.stem(x))
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        x = self.relu(x + y)
        x = self.avg(self.down(x))
        x = torch.flatten(self.gap(x), 1)
        return self.fc(x)


def build_cnn() -> torch.nn.Module:
    torch.manual_seed(42)
    model = SmallCNN()
    # Non-trivial running stats so BatchNorm (eval) is not the identity.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def export_with_external_data(model, example, path: Path, opset: int, in_name: str, out_name: str):
    """Export with the dynamo exporter and save every initializer to
    ``<path>.data`` (one file, size_threshold=0) next to the .onnx."""
    with torch.no_grad():
        prog = torch.onnx.export(
            model,
            (example,),
            None,
            input_names=[in_name],
            output_names=[out_name],
            dynamic_shapes=({0: "N"},),
            opset_version=opset,
            dynamo=True,
            optimize=True,
        )
    proto = prog.model_proto
    strip_metadata(proto)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    (path.parent / data_name).unlink(missing_ok=True)  # onnx appends otherwise
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=0,
    )
    reloaded = onnx.load(str(path), load_external_data=False)
    n_ext = sum(i.data_location == onnx.TensorProto.EXTERNAL for i in reloaded.graph.initializer)
    if n_ext == 0:
        raise RuntimeError(f"{path.name}: expected external initializers, found none")
    onnx.checker.check_model(str(path), full_check=True)
    return onnx.load(str(path))


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def make_decoder(name, builder, attn, opset, out_dir: Path, tol: float, report: dict, exporter=None):
    log(f"{name}: building ({attn} attention, opset {opset})")
    model = builder(attn)
    wrapper = DecoderWrapper(model).eval()
    path = out_dir / f"{name}.onnx"
    log(f"{name}: exporting -> {path}")
    proto = (exporter or export_decoder)(wrapper, opset, path)
    ops = op_types(proto)
    log(f"{name}: {len(proto.graph.node)} nodes, opset {opset_of(proto)}, ops {ops}")
    log(f"{name}: computing torch goldens")
    data, cases = decoder_goldens(wrapper)
    b2 = check_batch2_rows(data, tol)
    log(f"{name}: checking onnx vs torch on {len(cases)} cases")
    chk = Checker(path)
    for label, feeds, expected in cases:
        chk.check(feeds, expected, tol, label)
    onnx_tokens = chk.greedy(data["prompt"], N_GREEDY, wrapper.model)
    if onnx_tokens != data["greedy_tokens"].tolist():
        raise AssertionError(f"{name}: onnx greedy tokens {onnx_tokens} != torch {data['greedy_tokens'].tolist()}")
    log(f"{name}: {N_GREEDY} greedy tokens from the onnx model match torch")
    np.savez_compressed(out_dir / f"{name}.golden.npz", **data)
    log(f"{name}: max |onnx - torch|: {chk.max_diff} (ort load error: {chk.ort_error})")
    report[name] = {
        "opset": opset_of(proto),
        "nodes": len(proto.graph.node),
        "ops": ops,
        "max_diff": chk.max_diff,
        "ort_error": chk.ort_error,
        "batch2_row0_vs_prefill": b2,
        "greedy_tokens": data["greedy_tokens"].tolist(),
        "greedy_min_margin": float(data["greedy_min_margin"]),
    }
    return model


def make_cnn(out_dir: Path, tol: float, report: dict):
    log("cnn: building and exporting (opset 17, TorchScript exporter)")
    model = build_cnn()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 32, 32, generator=g)
    path = out_dir / "cnn.onnx"
    # The dynamo exporter fuses BatchNorm into Conv (its optimizer), lowers
    # AdaptiveAvgPool/flatten to ReduceMean/Reshape and cannot down-convert that
    # to opset 17. The legacy TorchScript exporter in EVAL mode without
    # constant folding keeps BatchNormalization, GlobalAveragePool and Flatten.
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(tmp),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
            opset_version=17,
            dynamo=False,
            training=torch.onnx.TrainingMode.EVAL,
            do_constant_folding=False,
        )
    proto = onnx.load(str(tmp))
    tmp.unlink()
    save_inline(proto, path)
    with torch.no_grad():
        y = model(x)
    feeds, expected = {"input": to_np(x)}, {"logits": to_np(y)}
    chk = Checker(path)
    chk.check(feeds, expected, tol, "batch2")
    np.savez_compressed(out_dir / "cnn.golden.npz", input=feeds["input"], logits=expected["logits"])
    report["cnn"] = {
        "opset": opset_of(proto),
        "nodes": len(proto.graph.node),
        "ops": op_types(proto),
        "max_diff": chk.max_diff,
    }
    log(f"cnn: ops {op_types(proto)}, max diff {chk.max_diff}")


def make_mlp(out_dir: Path, tol: float, report: dict):
    log("mlp: building and exporting with external data (opset 17)")
    torch.manual_seed(99)
    model = MLP().eval()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(11))
    path = out_dir / "external_data" / "mlp.onnx"
    proto = export_with_external_data(model, x, path, 17, "x", "y")
    with torch.no_grad():
        y = model(x)
    feeds, expected = {"x": to_np(x)}, {"y": to_np(y)}
    chk = Checker(path)
    chk.check(feeds, expected, tol, "batch3")
    np.savez_compressed(path.parent / "mlp.golden.npz", x=feeds["x"], y=expected["y"])
    report["external_data/mlp"] = {
        "opset": opset_of(proto),
        "nodes": len(proto.graph.node),
        "ops": op_types(proto),
        "max_diff": chk.max_diff,
    }
    log(f"mlp: ops {op_types(proto)}, max diff {chk.max_diff}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures")
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs diff onnx vs torch (default 1e-4)")
    ap.add_argument("--only", nargs="*", help="subset of fixtures to build (default: all)")
    args = ap.parse_args(argv)
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": __import__("onnxscript").__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
    }
    log(f"versions: {versions}")
    for pkg, want in PINNED.items():
        if versions[pkg] != want:
            log(f"WARNING: {pkg} {versions[pkg]} differs from {want} used for the committed fixtures")
    report: dict = {"versions": versions}
    previous = out_dir / "report.json"
    if args.only and previous.is_file():  # a partial run keeps the other fixtures' entries
        report = {**json.loads(previous.read_text()), "versions": versions}

    jobs = {
        "gpt2_eager": lambda: make_decoder("gpt2_eager", build_gpt2, "eager", 18, out_dir, args.tol, report),
        "gpt2_sdpa23": lambda: make_decoder("gpt2_sdpa23", build_gpt2, "sdpa", 23, out_dir, args.tol, report),
        "llama_eager": lambda: make_decoder("llama_eager", build_llama, "eager", 18, out_dir, args.tol, report),
        "llama_sdpa23": lambda: make_decoder("llama_sdpa23", build_llama, "sdpa", 23, out_dir, args.tol, report),
        "gpt2_torchscript": lambda: make_decoder(
            "gpt2_torchscript", build_gpt2, "eager", 17, out_dir, args.tol, report, export_decoder_torchscript
        ),
        "cnn": lambda: make_cnn(out_dir, args.tol, report),
        "mlp": lambda: make_mlp(out_dir, args.tol, report),
    }
    for name, job in jobs.items():
        if args.only and name not in args.only:
            continue
        job()

    sizes = {
        str(p.relative_to(out_dir)): p.stat().st_size
        for p in sorted(out_dir.rglob("*"))
        if p.is_file() and p.name not in NOT_MADE_HERE
    }
    report["sizes"] = sizes
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    for f, s in sizes.items():
        log(f"  {s:>9,d}  {f}")
    log(f"total {sum(sizes.values()):,d} bytes; report in {out_dir / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
