"""Special functions (Erf, exact Gelu) go through scipy.special: one compiled ufunc call, equal to scipy."""

from __future__ import annotations

import math
import sys

import ml_dtypes
import numpy as np
import pytest
import scipy.special

import dsp_core as dsp
from dsp_core.ops import special

EDGES = np.array(
    [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 2.9999, 3.0, 3.0001, 5.9, 6.0, 27.0, -27.0, np.inf, -np.inf, np.nan]
)


def _run(op: str, x: np.ndarray, **attrs: object) -> np.ndarray:
    g = dsp.GraphBuilder(op)
    xin = g.placeholder("x", str(x.dtype), list(x.shape))
    g.output(g.op(op, xin, **attrs), "y")
    return dsp.compile(g.build(), mode="slot_by_slot").run({"x": x})["y"]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_erf_equals_scipy(dtype: str) -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4096) * 3, EDGES]).astype(dtype)
    got = _run("Erf", x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, scipy.special.erf(x))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_erf_of_half_floats_is_computed_in_float32_and_rounded_once(dtype: str) -> None:
    x = np.linspace(-4, 4, 257, dtype=np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    got = _run("Erf", x)
    assert got.dtype == x.dtype
    want = scipy.special.erf(x.astype(np.float32)).astype(x.dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_erf_matches_the_math_module_to_double_precision() -> None:
    x = np.linspace(-7, 7, 1001)
    got = _run("Erf", x)
    want = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(got - want)) < 1e-15


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_gelu_is_x_times_phi(dtype: str) -> None:
    x = np.concatenate([np.random.default_rng(4).standard_normal(2048) * 4, EDGES[:-3]]).astype(dtype)
    got = _run("Gelu", x)
    want = (0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))).astype(dtype)
    np.testing.assert_allclose(got, want, rtol=2e-7 if dtype == "float32" else 1e-15, atol=1e-7)


def test_tanh_gelu_is_unchanged() -> None:
    x = np.linspace(-6, 6, 97, dtype=np.float32)
    got = _run("Gelu", x, approximate="tanh")
    v = x.astype(np.float64)
    want = 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_special_picks_scipy_for_numpy_and_cupyx_for_cupy_by_name() -> None:
    assert special.special(np) is scipy.special
    assert not special.is_cupy(np)

    class Wrapper:  # what a GPU backend hands kernels: cupy with matmul swapped
        __name__ = "cupy"

    assert special.is_cupy(Wrapper())


def test_without_scipy_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    special._scipy_special.cache_clear()
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.special", None)
    try:
        with pytest.raises(special.MissingDependencyError, match=r"pip install 'scipy>=1.11,<2'"):
            special.erf(np, np.zeros(3))
    finally:
        monkeypatch.undo()
        special._scipy_special.cache_clear()
    assert special.special(np) is scipy.special


def test_no_op_module_keeps_a_python_loop_over_array_elements() -> None:
    """The old erf summed 100 series terms over the whole array; no kernel loops like that now."""
    from pathlib import Path

    ops = Path(dsp.__file__).parent / "ops"
    for path in ops.glob("*.py"):
        text = path.read_text()
        assert "_erf_f64" not in text, path
        assert "np.vectorize" not in text and "frompyfunc" not in text, path
