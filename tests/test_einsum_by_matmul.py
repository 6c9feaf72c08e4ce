"""Einsum as sums, transposes and batched products (the form a capturing GPU backend runs) equals numpy's."""

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
