"""Random op kernels: shape, dtype, range and seeded reproducibility (values are not specified by ONNX)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dsp_core.ops.registry import KernelContext, Trait, lookup

FLOAT, FLOAT16, DOUBLE, BFLOAT16 = 1, 10, 11, 16
INT32, INT64, BOOL = 6, 7, 9


def _run(name: str, *inputs: Any, **attrs: Any) -> Any:
    ctx = KernelContext(np, 22, len(inputs), 1)
    return lookup(name).kernel(ctx, *inputs, **attrs)


@pytest.mark.parametrize("name", ["RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike"])
def test_traits(name: str) -> None:
    assert lookup(name).has(Trait.RANDOM)


@pytest.mark.parametrize(
    "code,dtype", [(FLOAT, np.float32), (FLOAT16, np.float16), (DOUBLE, np.float64), (BFLOAT16, ml_dtypes.bfloat16)]
)
def test_random_uniform_shape_dtype_range(code: int, dtype: Any) -> None:
    y = _run("RandomUniform", shape=[3, 4, 50], dtype=code, low=-2.0, high=3.0)
    assert y.shape == (3, 4, 50) and y.dtype == dtype
    values = y.astype(np.float64)
    assert values.min() >= -2.0 and values.max() <= 3.0
    assert values.std() > 0.5  # not a constant


def test_random_uniform_default_dtype_is_float32() -> None:
    y = _run("RandomUniform", shape=[2, 3])
    assert y.dtype == np.float32 and 0.0 <= y.min() and y.max() <= 1.0


def test_random_normal_statistics() -> None:
    y = _run("RandomNormal", shape=[20000], mean=5.0, scale=2.0, seed=3.0)
    assert y.dtype == np.float32
    assert abs(y.mean() - 5.0) < 0.1 and abs(y.std() - 2.0) < 0.1


@pytest.mark.parametrize("name", ["RandomUniformLike", "RandomNormalLike"])
def test_like_ops_take_input_shape_and_dtype(name: str) -> None:
    x = np.zeros((2, 5), np.float64)
    assert _run(name, x).dtype == np.float64 and _run(name, x).shape == (2, 5)
    assert _run(name, x, dtype=FLOAT16).dtype == np.float16


@pytest.mark.parametrize(
    "name,inputs,attrs",
    [
        ("RandomUniform", (), {"shape": [4, 4]}),
        ("RandomNormal", (), {"shape": [4, 4]}),
        ("RandomUniformLike", (np.zeros((4, 4), np.float32),), {}),
        ("RandomNormalLike", (np.zeros((4, 4), np.float32),), {}),
        ("Bernoulli", (np.full((4, 4), 0.5, np.float32),), {}),
        ("Multinomial", (np.zeros((4, 6), np.float32),), {"sample_size": 8}),
    ],
)
def test_seeded_is_reproducible(name: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> None:
    a = _run(name, *inputs, seed=7.0, **attrs)
    b = _run(name, *inputs, seed=7.0, **attrs)
    c = _run(name, *inputs, seed=8.0, **attrs)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_bernoulli_values_and_dtype() -> None:
    p = np.array([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]], np.float64)
    y = _run("Bernoulli", p)
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, p)
    assert _run("Bernoulli", p, dtype=BOOL).dtype == np.bool_
    assert _run("Bernoulli", p.astype(np.float32), dtype=INT64).dtype == np.int64
    frac = _run("Bernoulli", np.full(20000, 0.3, np.float32), seed=1.0).mean()
    assert abs(frac - 0.3) < 0.02


def test_multinomial_shape_dtype_and_distribution() -> None:
    logits = np.log(np.array([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]], np.float32) + 1e-30)
    y = _run("Multinomial", logits, sample_size=10000, seed=2.0)
    assert y.shape == (2, 10000) and y.dtype == np.int32
    assert set(np.unique(y[0])) <= {1, 2} and abs((y[0] == 2).mean() - 0.75) < 0.03
    assert (y[1] == 0).all()
    assert _run("Multinomial", logits, dtype=INT64).dtype == np.int64


def test_inputs_not_written() -> None:
    p = np.full((3, 3), 0.5, np.float32)
    before = p.copy()
    _run("Bernoulli", p)
    _run("Multinomial", p)
    _run("RandomNormalLike", p)
    np.testing.assert_array_equal(p, before)
