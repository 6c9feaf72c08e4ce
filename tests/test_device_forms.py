"""The forms a capturing GPU backend runs, equal to numpy's: Einsum as sums, transposes and batched
products, Det as Gaussian elimination in array ops, TreeEnsemble walking a depth found on the host."""

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


def _tree(true_id: list[int], false_id: list[int], true_leaf: list[int], false_leaf: list[int]) -> dict:
    n = len(true_id)
    return {
        "roots": np.array([0], np.int64),
        "mode": np.zeros(n, np.int64),
        "true_id": np.array(true_id, np.int64),
        "false_id": np.array(false_id, np.int64),
        "true_is_leaf": np.array(true_leaf, bool),
        "false_is_leaf": np.array(false_leaf, bool),
    }


def test_a_forests_depth_is_found_on_the_host_and_a_cycle_is_refused() -> None:
    from dsp_core.ops.ml import _depth

    # node 0 -> (node 1, leaf 0); node 1 -> (node 2, leaf 1); node 2 -> (leaf 2, leaf 3): three steps
    assert _depth(_tree([1, 2, 2], [0, 1, 3], [0, 0, 1], [1, 1, 1])) == 3
    assert _depth(_tree([0], [1], [1], [1])) == 1  # a root whose children are leaves
    with pytest.raises(ValueError, match="has a cycle"):
        _depth(_tree([1, 0], [0, 0], [0, 0], [1, 1]))  # 0 -> 1 -> 0
    with pytest.raises(ValueError, match="not among the 2 nodes"):
        _depth(_tree([5, 0], [0, 0], [0, 1], [1, 1]))


def test_tree_ensemble_builds_its_forest_once_per_slot_and_dtype() -> None:
    import dsp_core as dsp
    from dsp_core.ops.ml import tree_ensemble
    from dsp_core.ops.registry import KernelContext

    g = dsp.GraphBuilder("trees")
    x = g.placeholder("x", "float32", [None, 2])
    attrs = dict(
        aggregate_function=1,
        leaf_targetids=[0, 0, 0],
        leaf_weights=np.array([1.0, 2.0, 3.0], np.float32),
        n_targets=1,
        nodes_falseleafs=[1, 1],
        nodes_falsenodeids=[1, 2],
        nodes_featureids=[0, 1],
        nodes_modes=np.array([0, 0], np.uint8),
        nodes_splits=np.array([0.5, 0.0], np.float32),
        nodes_trueleafs=[0, 1],
        nodes_truenodeids=[1, 0],
        post_transform=0,
        tree_roots=[0],
    )
    g.output(g.op("TreeEnsemble", x, domain="ai.onnx.ml", **attrs), "y")
    model = dsp.compile(g.build(), mode="slot_by_slot")
    xs = np.array([[0.0, -1.0], [0.0, 1.0], [1.0, 0.0]], np.float32)
    # x0 <= 0.5 goes true to node 1; there x1 <= 0 goes true to leaf 0 (1.0), else leaf 2 (3.0); x0 > 0.5: leaf 1 (2.0)
    np.testing.assert_array_equal(model.run({"x": xs})["y"], [[1.0], [3.0], [2.0]])
    np.testing.assert_array_equal(model.run({"x": xs[::-1].copy()})["y"], [[2.0], [3.0], [1.0]])
    ctx = KernelContext(np, 5, 1, 1, "trees")
    first = tree_ensemble(ctx, xs, **attrs)
    forest = ctx.__dict__["tree_forests"]["float32"]
    np.testing.assert_array_equal(tree_ensemble(ctx, xs, **attrs), first)
    assert ctx.__dict__["tree_forests"]["float32"] is forest and forest.depth == 2


def test_a_leaf_target_past_n_targets_is_refused() -> None:
    from dsp_core.ops.ml import tree_ensemble
    from dsp_core.ops.registry import KernelContext

    attrs = dict(
        leaf_targetids=[0, 3],
        leaf_weights=np.array([1.0, 2.0], np.float32),
        n_targets=2,
        nodes_falseleafs=[1],
        nodes_falsenodeids=[1],
        nodes_featureids=[0],
        nodes_modes=np.array([0], np.uint8),
        nodes_splits=np.array([0.5], np.float32),
        nodes_trueleafs=[1],
        nodes_truenodeids=[0],
        tree_roots=[0],
    )
    with pytest.raises(ValueError, match=r"leaf_targetids must lie in \[0, 2\)"):
        tree_ensemble(KernelContext(np, 5, 1, 1, "t"), np.zeros((1, 1), np.float32), **attrs)
