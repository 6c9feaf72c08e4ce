"""ai.onnx.ml kernels and TfIdfVectorizer on what the node suite leaves out: a hand-computed
tree, aggregate functions, post transforms, NaN routing, the TF/IDF/TFIDF modes with skips,
numeric LabelEncoder forms. The oracle is onnxruntime where the hand computation is not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsp_core.errors import UnsupportedOpError
from dsp_core.ops.registry import KernelContext, lookup

ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ML = "ai.onnx.ml"


def _tensor_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """numpy attribute values as TensorProtos, the way a model stores them."""
    return {k: numpy_helper.from_array(v, k) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}


def _ort(
    op: str, x: np.ndarray, attrs: dict[str, Any], out_type: int, domain: str = ML, ml_opset: int = 5
) -> np.ndarray:
    node = helper.make_node(op, ["x"], ["y"], domain=domain, **_tensor_attrs(attrs))
    x_info = helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
    y_info = helper.make_tensor_value_info("y", out_type, None)
    graph = helper.make_graph([node], "g", [x_info], [y_info])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ML, ml_opset)])
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _dsp(op: str, *args: Any, domain: str = ML, **attrs: Any) -> Any:
    opdef = lookup(op, domain)
    opset = 5 if domain == ML else 21
    return opdef.kernel(KernelContext(np, opset, len(args), 1), *args, **attrs)


# A depth-2 tree on two features and a one-leaf tree, two targets:
#   node 0: x0 <= 0.5 ? node 1 : leaf 2       node 1: x1 < 2 ? leaf 0 : leaf 1
#   node 2: (a tree that is just leaf 3, both branches the same leaf)
TREES: dict[str, Any] = dict(
    tree_roots=[0, 2],
    nodes_featureids=[0, 1, 0],
    nodes_modes=np.array([0, 1, 0], np.uint8),
    nodes_splits=np.array([0.5, 2.0, 0.0], np.float32),
    nodes_truenodeids=[1, 0, 3],
    nodes_trueleafs=[0, 1, 1],
    nodes_falsenodeids=[2, 1, 3],
    nodes_falseleafs=[1, 1, 1],
    leaf_targetids=[0, 1, 0, 1],
    leaf_weights=np.array([1.0, 10.0, 100.0, 0.5], np.float32),
    n_targets=2,
)


def test_tree_ensemble_matches_hand_computed_walk() -> None:
    x = np.array([[0.0, 1.0], [0.0, 3.0], [1.0, 0.0], [np.nan, 0.0]], np.float32)
    got = _dsp("TreeEnsemble", x, **TREES)
    # Row 3: NaN fails x0 <= 0.5 (no missing-value tracking) and goes to leaf 2.
    want = np.array([[1.0, 0.5], [0.0, 10.5], [100.0, 0.5], [100.0, 0.5]], np.float32)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.float32
    tracked = _dsp("TreeEnsemble", x, **TREES, nodes_missing_value_tracks_true=[1, 0, 0])
    np.testing.assert_array_equal(tracked[3], [1.0, 0.5])  # NaN now follows the true branch


@pytest.mark.parametrize("aggregate_function", [0, 1, 2, 3])
@pytest.mark.parametrize("post_transform", [0, 1, 2, 3, 4])
def test_tree_ensemble_matches_onnxruntime(aggregate_function: int, post_transform: int) -> None:
    rng = np.random.default_rng(aggregate_function * 10 + post_transform)
    x = rng.uniform(-1.0, 3.0, (16, 2)).astype(np.float32)
    attrs = {**TREES, "aggregate_function": aggregate_function, "post_transform": post_transform}
    if post_transform == 4:  # PROBIT wants scores in (0, 1)
        attrs["leaf_weights"] = np.array([0.1, 0.3, 0.45, 0.2], np.float32)
    with np.errstate(divide="ignore"):  # PROBIT of a 0 score (a target no leaf hits) is -inf
        got = _dsp("TreeEnsemble", x, **attrs)
    # onnxruntime reads post_transform with its own enum, where LOGISTIC is 1 and SOFTMAX 2;
    # the spec (and DSP) has SOFTMAX 1, LOGISTIC 2 (see microsoft/onnxruntime#24862, #26596).
    ort_attrs = {**attrs, "post_transform": {1: 2, 2: 1}.get(post_transform, post_transform)}
    want = _ort("TreeEnsemble", x, ort_attrs, TensorProto.FLOAT)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_tree_ensemble_set_membership_and_double() -> None:
    attrs = dict(
        tree_roots=[0],
        nodes_featureids=[0, 0],
        nodes_modes=np.array([6, 6], np.uint8),
        nodes_splits=np.array([0.0, 0.0]),
        nodes_truenodeids=[0, 1],
        nodes_trueleafs=[1, 1],
        nodes_falsenodeids=[1, 2],
        nodes_falseleafs=[0, 1],
        membership_values=np.array([1.0, 4.0, np.nan, 7.0]),  # node 0: {1, 4}; node 1: {7}
        leaf_targetids=[0, 1, 2],
        leaf_weights=np.array([1.0, 2.0, 3.0]),
        n_targets=3,
    )
    x = np.array([[4.0], [7.0], [5.0]])
    got = _dsp("TreeEnsemble", x, **attrs)
    np.testing.assert_array_equal(got, [[1, 0, 0], [0, 2, 0], [0, 0, 3]])
    assert got.dtype == np.float64


def _tfidf_attrs(mode: str, **extra: Any) -> dict[str, Any]:
    # Unigrams 2, 3, 5 -> columns 0..2; bigrams (5, 6), (7, 8), (6, 7) -> columns 3..5.
    return dict(
        mode=mode,
        min_gram_length=1,
        max_gram_length=2,
        max_skip_count=1,
        ngram_counts=[0, 3],
        ngram_indexes=[0, 1, 2, 3, 4, 5],
        pool_int64s=[2, 3, 5, 5, 6, 7, 8, 6, 7],
        **extra,
    )


def test_tfidf_counts_unigrams_once_and_bigrams_per_skip() -> None:
    x = np.array([[5, 6, 7, 8, 5, 2, 6]], np.int32)
    got = _dsp("TfIdfVectorizer", x, domain="", **_tfidf_attrs("TF"))
    # 5 twice, 2 once; (5,6) at skip 1, (5,7) no, (6,7) at skip 1, (7,8) at skip 1, (5,6) again at skip 2 (5,2,6)
    np.testing.assert_array_equal(got, [[1, 0, 2, 2, 1, 1]])
    assert got.dtype == np.float32


def test_tfidf_makes_its_pool_tables_once_per_attribute_set() -> None:
    """A captured step must not copy the tables to the device each call: they are made once and reused."""
    from dsp_core.ops import ml

    attrs = _tfidf_attrs("TFIDF", weights=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    x = np.array([[5, 6, 7, 8, 5, 2, 6]], np.int64)
    ml._TF_IDF_TABLES.clear()
    first = _dsp("TfIdfVectorizer", x, domain="", **attrs)
    (tables,) = ml._TF_IDF_TABLES.values()
    again = _dsp("TfIdfVectorizer", x[:, ::-1].copy(), domain="", **attrs)
    (same,) = ml._TF_IDF_TABLES.values()
    assert same is tables and same[0] is tables[0] and same[2] is tables[2]  # vocabulary, weights: the same arrays
    np.testing.assert_array_equal(first, [[1, 0, 6, 8, 5, 6]])  # the TF counts above, times the weights
    assert again.shape == first.shape
    _dsp("TfIdfVectorizer", x, domain="", **_tfidf_attrs("TF"))  # other attributes: tables of their own
    assert len(ml._TF_IDF_TABLES) == 2


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", [(12,), (4, 9)])
def test_tfidf_matches_onnxruntime(mode: str, weighted: bool, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(len(shape)).integers(1, 10, shape).astype(np.int64)
    attrs = {**_tfidf_attrs(mode), "max_skip_count": 3}
    if weighted:
        attrs["weights"] = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    got = _dsp("TfIdfVectorizer", x, domain="", **attrs)
    want = _ort("TfIdfVectorizer", x, attrs, TensorProto.FLOAT, domain="")
    np.testing.assert_allclose(got, want)
    assert got.shape == want.shape


def test_tfidf_rejects_string_pool() -> None:
    with pytest.raises(UnsupportedOpError, match="string"):
        _dsp("TfIdfVectorizer", np.zeros(3, np.int64), domain="", **{**_tfidf_attrs("TF"), "pool_strings": ["a"]})


@pytest.mark.parametrize(
    ("x", "attrs", "out_type"),
    [
        (np.array([3, 1, 9, 3], np.int64), dict(keys_int64s=[1, 3], values_floats=[0.5, 1.5]), 1),
        (
            np.array([0.5, np.nan, 2.0], np.float32),
            dict(keys_floats=[0.5, float("nan")], values_int64s=[7, 8], default_int64=-5),
            7,
        ),
        (
            np.array([4, 2, 1], np.int64),
            dict(
                keys_tensor=np.array([1, 2], np.int64),
                values_tensor=np.array([10.0, 20.0]),
                default_tensor=np.array([-1.0]),
            ),
            11,
        ),
    ],
)
def test_label_encoder_numeric_forms_match_onnxruntime(x: np.ndarray, attrs: dict[str, Any], out_type: int) -> None:
    want = _ort("LabelEncoder", x, attrs, out_type, ml_opset=4)
    got = _dsp("LabelEncoder", x, **attrs)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype


def test_label_encoder_repeated_key_takes_the_last_value() -> None:
    # The spec's rule; onnxruntime keeps the first value instead.
    got = _dsp(
        "LabelEncoder",
        np.array([3, 1, 9], np.int16),
        keys_tensor=np.array([1, 3, 3], np.int16),
        values_tensor=np.array([5, 6, 7], np.int16),
    )
    np.testing.assert_array_equal(got, [7, 5, -1])
    assert got.dtype == np.int16


def test_array_feature_extractor_on_a_vector_gives_one_row() -> None:
    got = _dsp("ArrayFeatureExtractor", np.arange(5.0), np.array([[4, 0]]))
    np.testing.assert_array_equal(got, [[4.0, 0.0]])
    with pytest.raises(ValueError, match="indices"):
        _dsp("ArrayFeatureExtractor", np.arange(5.0), np.array([5]))


def test_binarizer_keeps_dtype() -> None:
    got = _dsp("Binarizer", np.array([-1, 0, 2], np.int64), threshold=0.0)
    np.testing.assert_array_equal(got, [0, 0, 1])
    assert got.dtype == np.int64
