"""Linear algebra, normalization and attention kernels on what the node suite leaves out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsp_core.errors import DTypeError
from dsp_core.ops.registry import KernelContext, TensorInfo, lookup


def _run(op: str, *args: Any, opset: int = 23, n_outputs: int = 1, **attrs: Any) -> Any:
    ctx = KernelContext(np, opset, len(args), n_outputs)
    return lookup(op).kernel(ctx, *args, **attrs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _plain_attention(q, k, v, mask, past_k, past_v, causal):
    """Textbook GQA attention: repeat kv heads, concat the cache, mask, softmax, weigh V."""
    k = np.concatenate([past_k, k], axis=2)
    v = np.concatenate([past_v, v], axis=2)
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ kr.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + mask
    if causal:
        sq, total = scores.shape[-2:]
        past = total - sq
        scores = np.where(np.arange(total) <= np.arange(sq)[:, None] + past, scores, -np.inf)
    return _softmax(scores) @ vr, k, v


@pytest.fixture
def gqa_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, hq, hkv, s, past, d, dv = 2, 6, 2, 3, 5, 8, 4
    return {
        "q": rng.standard_normal((b, hq, s, d)).astype(np.float32),
        "k": rng.standard_normal((b, hkv, s, d)).astype(np.float32),
        "v": rng.standard_normal((b, hkv, s, dv)).astype(np.float32),
        "mask": rng.standard_normal((b, 1, s, past + s)).astype(np.float32),
        "past_k": rng.standard_normal((b, hkv, past, d)).astype(np.float32),
        "past_v": rng.standard_normal((b, hkv, past, dv)).astype(np.float32),
    }


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_gqa_with_past_matches_plain_formula(gqa_inputs, causal):
    x = gqa_inputs
    copies = {name: a.copy() for name, a in x.items()}
    args = (x["q"], x["k"], x["v"], x["mask"], x["past_k"], x["past_v"])
    y, present_k, present_v, _ = _run("Attention", *args, n_outputs=3, is_causal=causal)
    want_y, want_k, want_v = _plain_attention(*args, causal=causal)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(present_k, want_k)
    np.testing.assert_array_equal(present_v, want_v)
    for name, a in x.items():  # inputs may be shared constants: never written
        np.testing.assert_array_equal(a, copies[name])


def test_attention_packed_3d_equals_4d(gqa_inputs):
    x = gqa_inputs

    def pack(a: np.ndarray) -> np.ndarray:
        b, h, s, d = a.shape
        return a.transpose(0, 2, 1, 3).reshape(b, s, h * d)

    args = (x["q"], x["k"], x["v"], x["mask"], x["past_k"], x["past_v"])
    y4 = _run("Attention", *args, n_outputs=3, is_causal=1)[0]
    packed = (pack(x["q"]), pack(x["k"]), pack(x["v"]), x["mask"], x["past_k"], x["past_v"])
    y3 = _run("Attention", *packed, n_outputs=3, is_causal=1, q_num_heads=6, kv_num_heads=2)[0]
    np.testing.assert_allclose(y3, pack(y4), rtol=1e-6)


def test_attention_half_inputs_keep_their_dtype(gqa_inputs):
    x = {name: a.astype(np.float16) for name, a in gqa_inputs.items()}
    args = (x["q"], x["k"], x["v"], x["mask"], x["past_k"], x["past_v"])
    y, present_k, _, qk = _run("Attention", *args, n_outputs=4, qk_matmul_output_mode=3)
    assert y.dtype == present_k.dtype == qk.dtype == np.float16
    want = _plain_attention(*[a.astype(np.float32) for a in args], causal=0)[0]
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_attention_fully_masked_row_is_zero_not_nan():
    q = k = v = np.ones((1, 1, 2, 4), np.float32)
    mask = np.array([[True, True], [False, False]])
    y, _, _, probs = _run("Attention", q, k, v, mask, n_outputs=4, qk_matmul_output_mode=3)
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[0, 0, 1], 0)
    np.testing.assert_array_equal(probs[0, 0, 1], 0)


def test_softmax_before_opset_13_coerces_to_2d():
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    got = _run("Softmax", x, opset=11, axis=1)
    np.testing.assert_allclose(got, _softmax(x.reshape(2, 12)).reshape(2, 3, 4), rtol=1e-6)
    default = _run("LogSoftmax", x, opset=11)  # default axis 1 before opset 13
    np.testing.assert_allclose(default, np.log(got), rtol=1e-5, atol=1e-6)


def test_hardmax_picks_the_first_maximum():
    x = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)
    np.testing.assert_array_equal(_run("Hardmax", x, opset=13), [[0, 1, 0, 0]])


def test_quantize_rounds_half_to_even_and_saturates():
    x = np.array([0.5, 1.5, 2.5, -0.5, 300.0, -300.0], np.float32)
    got = _run("QuantizeLinear", x, np.float32(1.0), np.int8(0))
    np.testing.assert_array_equal(got, np.array([0, 2, 2, 0, 127, -128], np.int8))
    assert _run("QuantizeLinear", x, np.float32(1.0)).dtype == np.uint8


def test_quantize_to_a_non_quantized_dtype_is_refused_with_a_dtype_error():
    with pytest.raises(DTypeError, match="not supported"):
        _run("QuantizeLinear", np.ones(2, np.float32), np.float32(1.0), output_dtype=6)  # int32


def test_dequantize_per_axis():
    x = np.arange(6, dtype=np.uint8).reshape(2, 3)
    scale = np.array([1.0, 2.0, 4.0], np.float32)
    zp = np.array([0, 1, 2], np.uint8)
    got = _run("DequantizeLinear", x, scale, zp, axis=1)
    np.testing.assert_array_equal(got, (x.astype(np.float32) - zp) * scale)


def test_group_norm_opset_18_scales_per_group():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 3)).astype(np.float32)
    scale, bias = np.array([2.0, 3.0], np.float32), np.array([0.5, -0.5], np.float32)
    old = _run("GroupNormalization", x, scale, bias, opset=18, num_groups=2)
    new = _run("GroupNormalization", x, np.repeat(scale, 2), np.repeat(bias, 2), opset=21, num_groups=2)
    np.testing.assert_allclose(old, new, rtol=1e-6)


def test_layer_norm_half_stashes_statistics_in_float32():
    x = np.random.default_rng(3).standard_normal((2, 5)).astype(np.float16)
    y, mean, inv_std = _run("LayerNormalization", x, np.ones(5, np.float16), n_outputs=3)
    assert (y.dtype, mean.dtype, inv_std.dtype) == (np.float16, np.float32, np.float32)
    assert mean.shape == (2, 1)


def test_rotary_embedding_packed_equals_4d():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)  # (B, H, S, D)
    angles = rng.standard_normal((1, 3, 4)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    y4 = _run("RotaryEmbedding", x, cos, sin, interleaved=1)
    packed = x.transpose(0, 2, 1, 3).reshape(1, 3, 16)
    y3 = _run("RotaryEmbedding", packed, cos, sin, interleaved=1, num_heads=2)
    np.testing.assert_allclose(y3, y4.transpose(0, 2, 1, 3).reshape(1, 3, 16), rtol=1e-6)
    # A rotation keeps each pair's norm.
    np.testing.assert_allclose(np.linalg.norm(y4, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize(
    ("op", "attrs", "inputs", "want"),
    [
        ("MatMul", {}, [(4,), ("B", 4, 5)], [("B", 5)]),
        ("MatMul", {}, [(2, 1, 3, 4), (7, 4, 5)], [(2, 7, 3, 5)]),
        ("Gemm", {"transA": 1, "transB": 1}, [(4, 3), (5, 4)], [(3, 5)]),
        ("Det", {}, [(2, 3, 3)], [(2,)]),
        ("Attention", {"q_num_heads": 4, "kv_num_heads": 2}, [(1, 3, 32), (1, 6, 16), (1, 6, 12)], [(1, 3, 24)]),
        ("LayerNormalization", {"axis": 1}, [(2, 3, 4), (3, 4)], [(2, 3, 4), (2, 1, 1), (2, 1, 1)]),
    ],
)
def test_shape_rules(op, attrs, inputs, want):
    infos = [TensorInfo("float32", shape) for shape in inputs]
    got = lookup(op).shape_rule(attrs, *infos)
    assert [info.shape for info in got[: len(want)]] == want
