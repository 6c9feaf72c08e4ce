"""Classical-ML ops: the ``ai.onnx.ml`` domain's Binarizer, ArrayFeatureExtractor,
LabelEncoder and TreeEnsemble, and the default domain's TfIdfVectorizer.

Only their numeric forms: DSP has no string tensors, so string keys, values and pools
raise UnsupportedOpError. The lookup tables these ops build from their attributes (sorted
keys, flattened trees, n-gram tries) are built with numpy and moved to ``ctx.xp``; the
inputs are then processed for the whole batch at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsp_core.errors import UnsupportedOpError
from dsp_core.ops.registry import KernelContext, TensorInfo, Trait, op, same_as_first

Array = Any
ML = "ai.onnx.ml"


# ---------------------------------------------------------------------------
# Binarizer, ArrayFeatureExtractor


@op("Binarizer", domain=ML, traits=Trait.ELEMENTWISE | Trait.FULLY_WRITING, shape=same_as_first)
def binarizer(ctx: KernelContext, x: Array, *, threshold: float = 0.0) -> Array:
    """1 where ``x`` is above ``threshold``, else 0 (NaN gives 0), in the dtype of ``x``."""
    return (x > threshold).astype(x.dtype)


def _feature_extractor_rule(attrs: dict[str, Any], data: TensorInfo, indices: TensorInfo) -> list[TensorInfo]:
    if data.shape is None or indices.shape is None:
        return [TensorInfo(data.dtype, None)]
    dims = [d for d in indices.shape if isinstance(d, int)]
    picked = math.prod(dims) if len(dims) == len(indices.shape) else None
    lead = (1,) if len(data.shape) == 1 else data.shape[:-1]
    return [TensorInfo(data.dtype, (*lead, picked))]


@op("ArrayFeatureExtractor", domain=ML, shape=_feature_extractor_rule)
def array_feature_extractor(ctx: KernelContext, data: Array, indices: Array) -> Array:
    """The entries of ``data``'s last axis at ``indices`` (flattened); a 1-D ``data`` gives one row."""
    xp = ctx.xp
    index = indices.reshape(-1).astype(xp.int64)
    width = data.shape[-1]
    if index.size and (int(index.min()) < 0 or int(index.max()) >= width):
        raise ValueError(f"ArrayFeatureExtractor: indices must lie in [0, {width}), got {index.tolist()}")
    picked = xp.take(data, index, axis=-1)
    return picked.reshape(1, -1) if data.ndim == 1 else picked


# ---------------------------------------------------------------------------
# LabelEncoder (opsets 2-4): keys_* -> values_*, numeric forms.


def _label_values(attrs: dict[str, Any]) -> tuple[np.ndarray | None, Any]:
    """The node's values as an array (None when it sets none) and its default value."""
    tensor = attrs.get("values_tensor")
    if tensor is not None:
        values = np.asarray(tensor).reshape(-1)
        given = attrs.get("default_tensor")
        if given is not None:
            return values, np.asarray(given).reshape(-1)[0]
        return values, -0.0 if values.dtype.kind == "f" else -1
    if attrs.get("values_floats") is not None:
        return np.asarray(attrs["values_floats"], np.float32), attrs.get("default_float", -0.0)
    if attrs.get("values_int64s") is not None:
        return np.asarray(attrs["values_int64s"], np.int64), attrs.get("default_int64", -1)
    return None, None


def _label_keys(attrs: dict[str, Any]) -> np.ndarray | None:
    """The node's keys as an array, None when it sets none."""
    if attrs.get("keys_tensor") is not None:
        return np.asarray(attrs["keys_tensor"]).reshape(-1)
    if attrs.get("keys_floats") is not None:
        return np.asarray(attrs["keys_floats"], np.float32)
    if attrs.get("keys_int64s") is not None:
        return np.asarray(attrs["keys_int64s"], np.int64)
    return None


def _label_encoder_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    values, _ = _label_values(attrs)
    return [TensorInfo(None if values is None else str(values.dtype), x.shape)]


def _sorted_mapping(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
    """Non-NaN keys sorted with their values (a repeated key keeps its last value), and NaN's value."""
    nan_value = None
    if keys.dtype.kind == "f" and np.isnan(keys).any():
        nan_value = values[np.flatnonzero(np.isnan(keys))[-1]]
        keep = ~np.isnan(keys)
        keys, values = keys[keep], values[keep]
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    last_of_run = np.append(keys[1:] != keys[:-1], True)
    return keys[last_of_run], values[last_of_run], nan_value


@op("LabelEncoder", domain=ML, since=2, traits=Trait.ELEMENTWISE | Trait.FULLY_WRITING, shape=_label_encoder_rule)
def label_encoder(
    ctx: KernelContext,
    x: Array,
    *,
    default_float: float = -0.0,
    default_int64: int = -1,
    default_string: str = "_Unused",
    default_tensor: np.ndarray | None = None,
    keys_floats: list[float] | None = None,
    keys_int64s: list[int] | None = None,
    keys_strings: list[str] | None = None,
    keys_tensor: np.ndarray | None = None,
    values_floats: list[float] | None = None,
    values_int64s: list[int] | None = None,
    values_strings: list[str] | None = None,
    values_tensor: np.ndarray | None = None,
) -> Array:
    """Each element of ``x`` mapped from its key to the paired value, the default where no key matches."""
    if keys_strings is not None or values_strings is not None:
        raise UnsupportedOpError("LabelEncoder with string keys or values: DSP has no string tensors")
    attrs = {k: v for k, v in locals().items() if k not in ("ctx", "x")}
    keys = _label_keys(attrs)
    values, default = _label_values(attrs)
    if keys is None or values is None or len(keys) != len(values):
        raise ValueError("LabelEncoder needs one keys_* and one values_* attribute of the same length")
    xp = ctx.xp
    keys, values, nan_value = _sorted_mapping(keys, values)
    out = xp.full(x.shape, default, dtype=values.dtype)
    if len(keys):
        table = xp.asarray(keys.astype(x.dtype))
        pos = xp.minimum(xp.searchsorted(table, x), len(keys) - 1)
        out = xp.where(table[pos] == x, xp.asarray(values)[pos], out)
    if nan_value is not None:
        out = xp.where(xp.isnan(x), xp.asarray(nan_value, dtype=values.dtype), out)
    return out


# ---------------------------------------------------------------------------
# TreeEnsemble (ai.onnx.ml opset 5). Every sample walks every tree at once: one step
# moves each (sample, tree) pair down one level, until all have reached a leaf.

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AVERAGE, _SUM, _MIN, _MAX = range(4)


@dataclass(frozen=True)
class _Forest:
    """The trees' nodes as parallel arrays (index = node id), and their leaves."""

    roots: Array
    feature: Array
    mode: Array
    split: Array
    members: Array  # [n_nodes, widest set], NaN-padded; width 0 when no node tests membership
    nan_goes_true: Array
    true_id: Array
    false_id: Array
    true_is_leaf: Array
    false_is_leaf: Array
    leaf_weight: Array
    leaf_target: Array
    depth: int = 0  # steps from the roots until every walk has reached a leaf (found on the host)


def _membership_sets(modes: np.ndarray, membership_values: np.ndarray | None, dtype: Any) -> np.ndarray:
    """Per node, its BRANCH_MEMBER set padded with NaN; sets come in node order, NaN-delimited."""
    member_nodes = np.flatnonzero(modes == _MEMBER)
    if len(member_nodes) == 0:
        return np.zeros((len(modes), 0), dtype)
    if membership_values is None:
        raise ValueError("TreeEnsemble: BRANCH_MEMBER nodes need the membership_values attribute")
    sets: list[list[float]] = [[]]
    for v in np.asarray(membership_values, np.float64).reshape(-1):
        if np.isnan(v):
            sets.append([])
        else:
            sets[-1].append(float(v))
    if not sets[-1] and len(sets) > len(member_nodes):
        sets.pop()  # a trailing NaN ends the last set
    if len(sets) != len(member_nodes):
        raise ValueError(f"TreeEnsemble: {len(member_nodes)} BRANCH_MEMBER nodes but {len(sets)} membership sets")
    table = np.full((len(modes), max(len(s) for s in sets)), np.nan, dtype)
    for node, members in zip(member_nodes, sets):
        table[node, : len(members)] = members
    return table


def _forest(xp: Any, dtype: Any, a: dict[str, Any]) -> _Forest:
    """The tree attributes as a _Forest on ``xp``; splits and members in the input's dtype."""
    modes = np.asarray(a["nodes_modes"]).reshape(-1).astype(np.int64)
    n_nodes = len(modes)
    tracks = a["nodes_missing_value_tracks_true"]
    nan_true = np.zeros(n_nodes, bool) if tracks is None else np.asarray(tracks, bool)
    host = {
        "roots": np.asarray(a["tree_roots"], np.int64),
        "feature": np.asarray(a["nodes_featureids"], np.int64),
        "mode": modes,
        "split": np.asarray(a["nodes_splits"]).reshape(-1).astype(dtype),
        "members": _membership_sets(modes, a["membership_values"], dtype),
        "nan_goes_true": nan_true,
        "true_id": np.asarray(a["nodes_truenodeids"], np.int64),
        "false_id": np.asarray(a["nodes_falsenodeids"], np.int64),
        "true_is_leaf": np.asarray(a["nodes_trueleafs"], bool),
        "false_is_leaf": np.asarray(a["nodes_falseleafs"], bool),
        "leaf_weight": np.asarray(a["leaf_weights"]).reshape(-1).astype(np.float64),
        "leaf_target": np.asarray(a["leaf_targetids"], np.int64),
    }
    targets = _n_targets(a) or 0
    if len(host["leaf_target"]) and (host["leaf_target"].min() < 0 or host["leaf_target"].max() >= targets):
        raise ValueError(f"TreeEnsemble: leaf_targetids must lie in [0, {targets}) (n_targets)")
    return _Forest(**{k: xp.asarray(v) for k, v in host.items()}, depth=_depth(host))


def _depth(host: dict[str, np.ndarray]) -> int:
    """How many steps every walk from a root needs to reach a leaf, from the node arrays on the host,
    so the walk itself never asks the device whether it is done (a capturing backend keeps it in its
    graph). Raises for a cycle and for a child id that is no node."""
    n_nodes = len(host["mode"])
    frontier = np.unique(host["roots"])
    steps = 0
    while frontier.size:
        if frontier.min() < 0 or frontier.max() >= n_nodes:
            raise ValueError(f"TreeEnsemble: node ids {frontier.tolist()[:8]} are not among the {n_nodes} nodes")
        steps += 1
        if steps > n_nodes:
            raise ValueError("TreeEnsemble: a tree has a cycle (a walk visited more nodes than there are)")
        children = [host["true_id"][frontier][~host["true_is_leaf"][frontier]]]
        children.append(host["false_id"][frontier][~host["false_is_leaf"][frontier]])
        frontier = np.unique(np.concatenate(children))
    return steps


def _goes_true(xp: Any, f: _Forest, node: Array, value: Array) -> Array:
    """Whether ``value`` takes the true branch of ``node`` (elementwise)."""
    split = f.split[node]
    if f.members.shape[1]:
        member = (value[..., None] == f.members[node]).any(axis=-1)
    else:
        member = xp.zeros(value.shape, bool)
    tests = xp.stack(
        [value <= split, value < split, value >= split, value > split, value == split, value != split, member], axis=-1
    )
    chosen = xp.take_along_axis(tests, f.mode[node][..., None], axis=-1)[..., 0]
    return chosen | (xp.isnan(value) & f.nan_goes_true[node])


def _leaves_reached(xp: Any, f: _Forest, x: Array) -> Array:
    """The leaf index each sample reaches in each tree: [N, n_trees]."""
    n = x.shape[0]
    node = xp.broadcast_to(f.roots, (n, f.roots.shape[0])).copy()
    at_leaf = xp.zeros(node.shape, bool)
    rows = xp.arange(n)[:, None]
    for _ in range(f.depth):  # the forest's depth, known on the host: no device read per step
        here = xp.where(at_leaf, 0, node)  # finished pairs look at node 0; their result is discarded
        true = _goes_true(xp, f, here, x[rows, f.feature[here]])
        step = xp.where(true, f.true_id[here], f.false_id[here])
        step_is_leaf = xp.where(true, f.true_is_leaf[here], f.false_is_leaf[here])
        node = xp.where(at_leaf, node, step)
        at_leaf = at_leaf | step_is_leaf
    return node


ONE_HOT_LIMIT = 1 << 22  # samples x trees x targets summed one-hot; past it, bincount


def _aggregate(xp: Any, weight: Array, target: Array, n_targets: int, function: int) -> Array:
    """Leaf weights [N, n_trees] combined per target: [N, n_targets]; a target no leaf hits is 0."""
    n, n_trees = weight.shape
    if function in (_SUM, _AVERAGE):
        if n * n_trees * n_targets <= ONE_HOT_LIMIT:
            # a one-hot sum: array ops only (CuPy's bincount reads the largest index on the host,
            # which a capture refuses)
            hit = target[:, :, None] == xp.arange(n_targets)
            total = xp.where(hit, weight[:, :, None], 0.0).sum(axis=1)
        else:
            flat = (xp.arange(n)[:, None] * n_targets + target).reshape(-1)
            total = xp.bincount(flat, weights=weight.reshape(-1), minlength=n * n_targets).reshape(n, n_targets)
        return total / n_trees if function == _AVERAGE else total
    if function not in (_MIN, _MAX):
        raise ValueError(f"TreeEnsemble: aggregate_function must be 0..3 (AVERAGE, SUM, MIN, MAX), got {function}")
    reduce, empty = (xp.min, xp.inf) if function == _MIN else (xp.max, -xp.inf)
    out = xp.zeros((n, n_targets), weight.dtype)
    for k in range(n_targets):  # MIN and MAX have no bincount; targets are few
        hit = target == k
        best = reduce(xp.where(hit, weight, empty), axis=1)
        out[:, k] = xp.where(hit.any(axis=1), best, 0.0)
    return out


def _erfinv(xp: Any, y: Array) -> Array:
    """Winitzki's closed-form inverse error function (a = 0.147), as onnxruntime's PROBIT uses."""
    a = 0.147
    log = xp.log((1.0 - y) * (1.0 + y))
    t = 2.0 / (math.pi * a) + 0.5 * log
    return xp.sign(y) * xp.sqrt(xp.sqrt(t * t - log / a) - t)


def _post_transform(xp: Any, scores: Array, kind: int) -> Array:
    """NONE (0), SOFTMAX (1), LOGISTIC (2), SOFTMAX_ZERO (3) or PROBIT (4), per row."""
    if kind == 0:
        return scores
    if kind == 1:
        e = xp.exp(scores - scores.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if kind == 2:
        return xp.exp(-xp.logaddexp(0.0, -scores))
    if kind == 3:  # softmax over the non-zero scores; zeros stay zero, an all-zero row gives 0.5
        top = scores.max(axis=1, keepdims=True)
        e = xp.where(xp.abs(scores) > 1e-7, xp.exp(scores - top), scores * xp.exp(-top))
        total = e.sum(axis=1, keepdims=True)
        return xp.where(total == 0, 0.5, e / xp.where(total == 0, 1.0, total))
    if kind == 4:
        return math.sqrt(2.0) * _erfinv(xp, 2.0 * scores - 1.0)
    raise ValueError(f"TreeEnsemble: post_transform must be 0..4, got {kind}")


def _n_targets(attrs: dict[str, Any]) -> int | None:
    if attrs.get("n_targets") is not None:
        return int(attrs["n_targets"])
    targets = attrs.get("leaf_targetids")
    return int(max(targets)) + 1 if targets else None


def _tree_ensemble_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    rows = None if x.shape is None else x.shape[0]
    return [TensorInfo(x.dtype, (rows, _n_targets(attrs)))]


@op("TreeEnsemble", domain=ML, since=5, shape=_tree_ensemble_rule)
def tree_ensemble(
    ctx: KernelContext,
    x: Array,
    *,
    aggregate_function: int = 1,
    leaf_targetids: list[int],
    leaf_weights: np.ndarray,
    membership_values: np.ndarray | None = None,
    n_targets: int | None = None,
    nodes_falseleafs: list[int],
    nodes_falsenodeids: list[int],
    nodes_featureids: list[int],
    nodes_hitrates: np.ndarray | None = None,
    nodes_missing_value_tracks_true: list[int] | None = None,
    nodes_modes: np.ndarray,
    nodes_splits: np.ndarray,
    nodes_trueleafs: list[int],
    nodes_truenodeids: list[int],
    post_transform: int = 0,
    tree_roots: list[int],
) -> Array:
    """Scores [N, n_targets] of samples ``x`` [N, F]: each tree's leaf weight, aggregated per target."""
    xp = ctx.xp
    attrs = {k: v for k, v in locals().items() if k not in ("ctx", "x", "xp")}
    # made once per slot and dtype: the attributes never change, and building the device arrays
    # anew each call would copy them from the host every step (a capture refuses that)
    forests = ctx.__dict__.setdefault("tree_forests", {})
    forest = forests.get(str(x.dtype))
    if forest is None:
        forest = forests[str(x.dtype)] = _forest(xp, x.dtype, attrs)
    leaf = _leaves_reached(xp, forest, x)
    scores = _aggregate(
        xp, forest.leaf_weight[leaf], forest.leaf_target[leaf], _n_targets(attrs) or 0, aggregate_function
    )
    return _post_transform(xp, scores, post_transform).astype(x.dtype)


# ---------------------------------------------------------------------------
# TfIdfVectorizer. The pool's n-grams of each length form a trie, flattened into one
# sorted key array per level: a prefix's code at level k is its position among the
# level's keys ``code(k-1) * vocabulary size + token``. Input n-grams are encoded the
# same way with searchsorted, so every row, start and skip is matched at once.


@dataclass(frozen=True)
class _NgramTable:
    """The pool's n-grams of one length: the trie's level keys and each n-gram's output column."""

    length: int
    levels: tuple[Array, ...]  # levels 2..length (level 1 is the token's vocabulary index)
    column: Array  # final code -> output column; -1 for a code that is no pool n-gram


def _ngram_table(xp: Any, grams: np.ndarray, columns: np.ndarray, vocab_size: int) -> _NgramTable:
    """The table of ``grams`` [count, length] (tokens as vocabulary indices)."""
    code = grams[:, 0]
    levels = []
    for k in range(1, grams.shape[1]):
        key = code * vocab_size + grams[:, k]
        levels.append(np.unique(key))
        code = np.searchsorted(levels[-1], key)
    column = np.full(vocab_size if not levels else len(levels[-1]), -1, np.int64)
    _, last = np.unique(code[::-1], return_index=True)  # a repeated n-gram keeps its last column
    last = len(code) - 1 - last
    column[code[last]] = columns[last]
    return _NgramTable(grams.shape[1], tuple(xp.asarray(lv) for lv in levels), xp.asarray(column))


def _ngram_tables(
    xp: Any, pool: np.ndarray, counts: list[int], indexes: np.ndarray, lengths: range
) -> tuple[Array, list[_NgramTable]]:
    """The pool's vocabulary (sorted) and a table per n-gram length in ``lengths``."""
    vocab = np.unique(pool)
    tables = []
    ends = [*counts[1:], len(pool)]
    first = 0  # position of the length's first n-gram among all pool n-grams
    for n, (start, end) in enumerate(zip(counts, ends), start=1):
        grams = pool[start : start + (end - start) // n * n].reshape(-1, n)
        if n in lengths and len(grams):
            tokens = np.searchsorted(vocab, grams)
            tables.append(_ngram_table(xp, tokens, indexes[first : first + len(grams)], len(vocab)))
        first += len(grams)
    return xp.asarray(vocab), tables


def _ngram_hits(xp: Any, tokens: Array, table: _NgramTable, skip: int, vocab_size: int) -> tuple[Array, Array]:
    """For n-grams of every start with ``skip``: (found mask, output column) arrays [rows, starts]."""
    starts = tokens.shape[1] - (table.length - 1) * skip
    code = tokens[:, :starts]
    found = code >= 0
    for k, level in enumerate(table.levels, start=1):
        token = tokens[:, k * skip : k * skip + starts]
        key = code * vocab_size + token
        pos = xp.minimum(xp.searchsorted(level, key), level.shape[0] - 1)
        found = found & (token >= 0) & (level[pos] == key)
        code = pos
    column = table.column[xp.where(found, code, 0)]
    return found & (column >= 0), column


def _tf_idf_rule(attrs: dict[str, Any], x: TensorInfo) -> list[TensorInfo]:
    width = max(attrs["ngram_indexes"]) + 1
    if x.shape is None:
        return [TensorInfo("float32", None)]
    return [TensorInfo("float32", (width,) if len(x.shape) < 2 else (x.shape[0], width))]


@op("TfIdfVectorizer", since=9, shape=_tf_idf_rule)
def tf_idf_vectorizer(
    ctx: KernelContext,
    x: Array,
    *,
    max_gram_length: int,
    max_skip_count: int,
    min_gram_length: int,
    mode: str,
    ngram_counts: list[int],
    ngram_indexes: list[int],
    pool_int64s: list[int] | None = None,
    pool_strings: list[str] | None = None,
    weights: list[float] | None = None,
) -> Array:
    """Counts of the pool's n-grams in each row of ``x`` (skips allowed), weighted as ``mode`` says."""
    if pool_strings is not None:
        raise UnsupportedOpError("TfIdfVectorizer with pool_strings: DSP has no string tensors")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ValueError(f"TfIdfVectorizer: mode must be TF, IDF or TFIDF, got {mode!r}")
    xp = ctx.xp
    width = max(ngram_indexes) + 1
    rows = x.reshape(1, -1) if x.ndim < 2 else x
    counts = xp.zeros((rows.shape[0], width), xp.float32)
    lengths = range(min_gram_length, max_gram_length + 1)
    # The pool's tables (and the weights) are made once per attribute set and device, so a
    # captured step neither copies them to the device nor reads anything back: every hit is
    # added in place, none is selected by a mask (whose size only the host would know).
    vocab, tables, scale = _tf_idf_tables(
        xp, tuple(pool_int64s or ()), tuple(ngram_counts), tuple(ngram_indexes), lengths, tuple(weights or ())
    )
    if vocab is not None and rows.size:
        where = xp.minimum(xp.searchsorted(vocab, rows.astype(xp.int64)), vocab.shape[0] - 1)
        tokens = xp.where(vocab[where] == rows, where, -1)
        offset = xp.arange(rows.shape[0])[:, None] * width
        flat_counts = counts.reshape(-1)
        for table in tables:
            skips = range(1, 2) if table.length == 1 else range(1, max_skip_count + 2)  # unigrams count once
            for skip in skips:
                if (table.length - 1) * skip >= rows.shape[1]:
                    break
                found, column = _ngram_hits(xp, tokens, table, skip, vocab.shape[0])
                xp.add.at(
                    flat_counts, xp.where(found, offset + column, 0).reshape(-1), found.astype(xp.float32).reshape(-1)
                )
    if mode != "TF":
        if mode == "IDF":
            counts = (counts > 0).astype(xp.float32)
        if scale is not None:
            counts = counts * scale
    return counts.reshape(width) if x.ndim < 2 else counts


_TF_IDF_TABLES: dict[tuple[Any, ...], tuple[Array | None, list[_NgramTable], Array | None]] = {}


def _tf_idf_tables(
    xp: Any,
    pool: tuple[int, ...],
    counts: tuple[int, ...],
    indexes: tuple[int, ...],
    lengths: range,
    weights: tuple[float, ...],
) -> tuple[Array | None, list[_NgramTable], Array | None]:
    """(vocabulary, tables, weights) on ``xp``'s current device, made once per attribute set (None: empty)."""
    device = getattr(getattr(xp, "cuda", None), "Device", None)
    key = (xp.__name__, device().id if device is not None else None, pool, counts, indexes, lengths, weights)
    got = _TF_IDF_TABLES.get(key)
    if got is None:
        if len(_TF_IDF_TABLES) >= 64:  # bounded: a model has a few such nodes
            _TF_IDF_TABLES.pop(next(iter(_TF_IDF_TABLES)))
        vocab: Array | None = None
        tables: list[_NgramTable] = []
        if pool:
            vocab, tables = _ngram_tables(
                xp, np.asarray(pool, np.int64), list(counts), np.asarray(indexes, np.int64), lengths
            )
        got = (vocab, tables, xp.asarray(weights, xp.float32) if weights else None)
        _TF_IDF_TABLES[key] = got
    return got
