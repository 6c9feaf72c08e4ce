"""The ONNX export recipe for KV-cache decoders, shared by scripts/make_fixtures.py and
benchmarks/decode_gpu.py (GPT-2 and Llama families alike).

A transformers causal LM is wrapped so its forward takes flat tensors
``(input_ids, attention_mask, position_ids, [k0, v0, k1, v1, ...])`` and returns
``(logits, present k0, present v0, ...)``; torch's dynamo exporter then writes inputs
``past_key_values.{i}.key/value`` and outputs ``present.{i}.key/value`` with every dim
dynamic. Pitfalls this recipe avoids (tests/fixtures/README.md): ``dynamic_axes`` fails
on a ``*past`` signature under dynamo (a list plus ``dynamic_shapes`` works), and a trace
with a size-0/1 dim specialises it (batch 2, seq 3, past 4 here).

Needs torch and transformers (the fixture venv, or the GPU image); not a dependency of DSP.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 2, 3, 4  # no size 0/1 dims, or the exporter specialises them


class DecoderWrapper(torch.nn.Module):
    """Flat-tensor interface: (ids, mask, pos, [k0, v0, k1, v1, ...]) ->
    (logits, present k0, present v0, ...)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config
        # transformers 5.x renamed the forward's ``past_key_values=`` to ``cache=``
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, past: list[torch.Tensor]) -> Any:
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        cache = DynamicCache(pairs, config=self.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self.cache_kw: cache},
        )
        kv = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        flat = []
        for layer in kv.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def kv_dims(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a GPT-2 or Llama config."""
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    n_heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return n_layers, kv_heads, head_dim


def input_names(n_layers: int) -> list[str]:
    """input_ids, attention_mask, position_ids, then past_key_values.{i}.key/value."""
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(n_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def output_names(n_layers: int) -> list[str]:
    """logits, then present.{i}.key/value."""
    names = ["logits"]
    for i in range(n_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


def trace_inputs(model: torch.nn.Module, device: Any = None, dtype: Any = None) -> tuple[Any, Any, Any, list[Any]]:
    """The example inputs of the trace (seed 0, drawn on the CPU): ids, mask, positions, past."""
    n_layers, kv_heads, head_dim = kv_dims(model)
    batch, seq, past_len = TRACE_BATCH, TRACE_SEQ, TRACE_PAST
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq).unsqueeze(0).repeat(batch, 1)
    past = [torch.randn(batch, kv_heads, past_len, head_dim, generator=g) for _ in range(2 * n_layers)]
    place = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    if place:
        ids, mask, pos = (t.to(device) if device is not None else t for t in (ids, mask, pos))
        past = [t.to(**place) for t in past]
    return ids, mask, pos, past


def export_decoder_program(
    wrapper: DecoderWrapper, opset: int, *, device: Any = None, dtype: Any = None, external_data: bool = False
) -> Any:
    """torch.onnx.export(dynamo=True) of ``wrapper``: flat KV names, batch/seq/past/total dynamic.

    Returns the ONNXProgram (``.model_proto``, ``.save(path, external_data=...)``).
    ``device``/``dtype`` place the trace's past tensors beside the model's weights.
    """
    n_layers = kv_dims(wrapper.model)[0]
    B, S, P, T = "batch", "seq", "past", "total"
    dyn = {
        "input_ids": {0: B, 1: S},
        "attention_mask": {0: B, 1: T},
        "position_ids": {0: B, 1: S},
        "past": [{0: B, 2: P} for _ in range(2 * n_layers)],
    }
    with torch.no_grad():
        return torch.onnx.export(
            wrapper,
            trace_inputs(wrapper.model, device, dtype),
            None,
            input_names=input_names(n_layers),
            output_names=output_names(n_layers),
            dynamic_shapes=dyn,
            opset_version=opset,
            dynamo=True,
            external_data=external_data,
            optimize=True,
            verbose=False,
        )
