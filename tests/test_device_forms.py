"""Einsum as sums, transposes and batched products, and Det as Gaussian elimination in array ops (the
forms a capturing GPU backend runs), equal numpy's."""

from __future__ import annotations

import numpy as np
import pytest

from dsp_core.ops.linalg import einsum_by_matmul

EQUATIONS = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),  # the ONNX cases' batch_matmul
    ("i,i", [(5,), (5,)]),  # inner product, implicit output: a scalar
    ("i,j->ij", [(3,), (4,)]),  # outer
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij", [(3, 4)]),  # implicit: sorted labels
    ("bhqd,bhkd->bhqk", [(2, 3, 5, 8), (2, 3, 6, 8)]),  # attention scores
    ("bhqk,bhkd->bqhd", [(2, 3, 5, 6), (2, 3, 6, 8)]),  # weighted sum, heads moved
    ("abc,cd,de->abe", [(2, 3, 4), (4, 5), (5, 6)]),  # three operands
    ("ijk,kl->il", [(2, 3, 4), (4, 5)]),  # j summed alone
    ("ij,jk,ki->", [(3, 4), (4, 5), (5, 3)]),  # a trace of a product
    ("nc,nc->n", [(4, 7), (4, 7)]),
    (" b i , b j -> b i j ", [(2, 3), (2, 4)]),  # spaces
    ("ij,jk->ik", [(3, 0), (0, 5)]),  # empty contraction
    ("ii->i", [(4, 4)]),  # a diagonal: numpy's own einsum
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),  # an ellipsis: numpy's own
]


@pytest.mark.parametrize(("equation", "shapes"), EQUATIONS, ids=[e for e, _ in EQUATIONS])
def test_einsum_by_matmul_is_numpys_einsum(equation: str, shapes: list[tuple[int, ...]]) -> None:
    rng = np.random.default_rng(0)
    operands = [rng.standard_normal(s) for s in shapes]
    got = einsum_by_matmul(np, equation, *operands)
    want = np.einsum(equation.replace(" ", ""), *operands)
    assert np.shape(got) == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_products_go_through_the_backends_matmul() -> None:
    """Every product of a plain equation is one xp.matmul call, never xp.einsum."""
    calls: list[str] = []

    class XP:
        def matmul(self, a, b):  # type: ignore[no-untyped-def]
            calls.append("matmul")
            return np.matmul(a, b)

        def einsum(self, *args):  # type: ignore[no-untyped-def]
            calls.append("einsum")
            return np.einsum(*args)

    a, b, c = np.ones((2, 3)), np.ones((3, 4)), np.ones((4, 5))
    einsum_by_matmul(XP(), "ij,jk,kl->il", a, b, c)
    assert calls == ["matmul", "matmul"]
    einsum_by_matmul(XP(), "ii->i", np.eye(3))
    assert calls[-1] == "einsum"


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (5, 5), (2, 4, 4), (3, 2, 6, 6), (0, 0), (2, 0, 0)])
def test_det_by_elimination_is_numpys_det(shape: tuple[int, ...]) -> None:
    from dsp_core.ops.linalg import det_by_elimination

    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape)
    got = det_by_elimination(np, a)
    want = np.linalg.det(a) if shape[-1] else np.ones(shape[:-2])
    assert got.shape == np.shape(want)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert np.array_equal(a, rng.__class__(np.random.PCG64(1)).standard_normal(shape))  # the input is untouched


def test_det_by_elimination_of_singular_and_pivoting_matrices() -> None:
    from dsp_core.ops.linalg import det_by_elimination

    singular = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]])
    zero_column = np.array([[0.0, 1.0], [0.0, 2.0]])
    needs_swap = np.array([[0.0, 1.0], [1.0, 0.0]])  # det -1: a zero first pivot, rows swapped
    got = det_by_elimination(np, np.stack([singular[:2, :2], zero_column, needs_swap]))
    np.testing.assert_allclose(got, [0.0, 0.0, -1.0], atol=1e-12)
    np.testing.assert_allclose(det_by_elimination(np, singular), 0.0, atol=1e-12)
    f32 = np.random.default_rng(2).standard_normal((4, 7, 7)).astype(np.float32)
    got32 = det_by_elimination(np, f32)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, np.linalg.det(f32.astype(np.float64)), rtol=1e-4)
