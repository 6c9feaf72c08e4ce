"""The cuDNN binding's pure-Python part: ONNX Conv attributes as cuDNN arguments (CPU, no cuDNN needed).

The output shape it computes must be the reference convolution's for every accepted case;
what cuDNN cannot take (asymmetric padding, other ranks and dtypes) is refused with a reason.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dsp_cuda_graphs.cudnn import Unsupported, conv_geometry, packed_strides

import dsp_core as dsp


def _reference_shape(x_shape: tuple[int, ...], w_shape: tuple[int, ...], **attrs: object) -> tuple[int, ...]:
    g = dsp.GraphBuilder("conv")
    x = g.placeholder("x", "float32", list(x_shape))
    w = g.constant(np.ones(w_shape, np.float32))
    g.output(g.op("Conv", x, w, **{k: v for k, v in attrs.items() if v is not None}), "y")
    y = dsp.compile(g.build(), mode="slot_by_slot").run({"x": np.ones(x_shape, np.float32)})["y"]
    return tuple(y.shape)


CASES = [
    ((1, 3, 9, 9), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 4, 10, 7), (6, 2, 3, 2), {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 0]}),
    ((1, 8, 11, 11), (8, 1, 3, 3), {"group": 8, "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ((1, 3, 9, 9), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 3, 8, 8), (4, 3, 3, 3), {"auto_pad": "VALID"}),
    ((2, 5, 17), (3, 5, 4), {"strides": [3], "pads": [2, 2]}),
    ((1, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1], "strides": [1, 2, 1]}),
]


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), CASES)
def test_the_output_shape_is_the_reference_convolutions(x_shape, w_shape, attrs) -> None:  # type: ignore[no-untyped-def]
    geo = conv_geometry(x_shape, w_shape, "float32", **attrs)
    want = _reference_shape(x_shape, w_shape, **attrs)
    got = geo.y_shape[:2] + geo.y_shape[3:] if geo.lifted else geo.y_shape
    assert got == want
    assert len(geo.pads) == len(geo.strides) == len(geo.dilations) == len(geo.x_shape) - 2 >= 2


def test_a_1d_convolution_is_lifted_to_2d_with_unit_height() -> None:
    geo = conv_geometry((2, 5, 17), (3, 5, 4), "float16", strides=[3], pads=[2, 2], dilations=[2])
    assert geo.lifted and geo.x_shape == (2, 5, 1, 17) and geo.w_shape == (3, 5, 1, 4)
    assert geo.pads == (0, 2) and geo.strides == (1, 3) and geo.dilations == (1, 2)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"pads": [0, 0, 1, 1]}, "asymmetric padding"),
        ({"auto_pad": "SAME_UPPER"}, "asymmetric padding"),  # an even kernel: one more after than before
        ({"group": 3}, "channels"),
    ],
)
def test_what_cudnn_cannot_take_is_refused_with_its_reason(kw: dict, why: str) -> None:
    with pytest.raises(Unsupported, match=why):
        conv_geometry((1, 4, 8, 8), (4, 4, 2, 2), "float32", **kw)


def test_other_dtypes_and_ranks_are_refused() -> None:
    with pytest.raises(Unsupported, match="dtype int8"):
        conv_geometry((1, 4, 8, 8), (4, 4, 3, 3), "int8")
    with pytest.raises(Unsupported, match="4-D convolution"):
        conv_geometry((1, 1, 4, 4, 4, 4), (1, 1, 1, 1, 1, 1), "float32")


def test_packed_strides_are_row_major() -> None:
    for shape in itertools.product((1, 3), (2, 5), (4,)):
        assert packed_strides(shape) == tuple(s // 4 for s in np.empty(shape, np.float32).strides)


def test_the_algorithm_is_the_best_over_every_round_of_the_search() -> None:
    from dsp_cuda_graphs.cudnn import DETERMINISTIC, Timing, pick_algorithm

    slow_first = [
        Timing(0, 0, 0.04, 0, DETERMINISTIC),
        Timing(1, 0, 0.90, 1 << 20, DETERMINISTIC),
    ]  # 1's kernels loading
    warm = [Timing(1, 0, 0.01, 1 << 20, DETERMINISTIC), Timing(0, 0, 0.05, 0, DETERMINISTIC)]
    best, times = pick_algorithm([slow_first, warm], 256 << 20, deterministic=True)
    assert best.algo == 1 and times == {0: 0.04, 1: 0.01}
    # what did not run, needs more workspace than there is, or is not deterministic where asked is left out
    failed = [Timing(2, 3, 0.001, 0, DETERMINISTIC), Timing(4, 0, 0.002, 1 << 30, DETERMINISTIC)]
    loose = [Timing(5, 0, 0.003, 0, 0)]
    assert pick_algorithm([warm, failed, loose], 256 << 20, deterministic=True)[0].algo == 1
    assert pick_algorithm([warm, failed, loose], 256 << 20, deterministic=False)[0].algo == 5
    with pytest.raises(Unsupported, match="is deterministic"):
        pick_algorithm([failed, loose], 256 << 20, deterministic=True)


def test_the_shortlist_is_the_searchs_best_then_the_heuristics_first_choices() -> None:
    from dsp_cuda_graphs.cudnn import DETERMINISTIC, Timing, shortlist

    searched = [
        [Timing(0, 0, 0.30, 0, DETERMINISTIC), Timing(1, 0, 0.05, 1 << 20, DETERMINISTIC)],
        [Timing(0, 0, 0.02, 0, DETERMINISTIC), Timing(6, 0, 0.40, 0, DETERMINISTIC)],
        [Timing(7, 0, 0.01, 1 << 30, DETERMINISTIC), Timing(5, 0, 0.001, 0, 0), Timing(2, 3, 0.0, 0, DETERMINISTIC)],
    ]
    heuristic = [Timing(1, 0, -1.0, 0, DETERMINISTIC), Timing(4, 0, -1.0, 0, DETERMINISTIC)]
    # 0 at its best time first, then 1; 7 needs too much workspace, 5 is not deterministic, 2 failed;
    # the heuristics add 4 (1 is there already)
    assert [t.algo for t in shortlist(searched, heuristic, 256 << 20, True, 2)] == [0, 1, 4]
    assert [t.algo for t in shortlist(searched, heuristic, 256 << 20, False, 2)] == [5, 0, 1, 4]
    assert [t.algo for t in shortlist(searched, [], 256 << 20, True, 4)] == [0, 1, 6]


def test_an_unknown_search_is_refused_before_cudnn_loads() -> None:
    from dsp_cuda_graphs.cudnn import Cudnn

    with pytest.raises(ValueError, match="DSP_CUDNN_ALGO 'fastest': one of timed, find, heuristic"):
        Cudnn(None, False, True, search="fastest")


@pytest.mark.parametrize(
    ("x_shape", "attrs"),
    [
        ((1, 64, 112, 112), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}),  # ResNet's
        ((2, 3, 8, 9), {"kernel_shape": [2, 2], "strides": [2, 2]}),
        ((2, 3, 10), {"kernel_shape": [3], "strides": [1]}),
        ((1, 2, 5, 6, 7), {"kernel_shape": [2, 3, 2], "pads": [1, 1, 0, 1, 1, 0]}),
        ((1, 2, 9, 9), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [1, 1]}),
    ],
)
def test_a_max_pool_cudnn_takes_has_the_reference_output_shape(x_shape, attrs) -> None:  # type: ignore[no-untyped-def]
    from dsp_cuda_graphs.cudnn import pool_geometry

    from dsp_core.ops.conv import max_pool
    from dsp_core.ops.registry import KernelContext

    g = pool_geometry(x_shape, "float32", **attrs)
    want = max_pool(KernelContext(np, 22, 1, 1, "p"), np.zeros(x_shape, np.float32), **attrs)[0].shape
    assert (g.y_shape[:2] + g.y_shape[3:] if g.lifted else g.y_shape) == want
    assert len(g.window) == len(g.pads) == len(g.strides) == len(g.x_shape) - 2


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        ({"kernel_shape": [3, 3], "dilations": [2, 2]}, "dilations"),
        ({"kernel_shape": [2, 2], "pads": [2, 2, 2, 2]}, "as wide as the window"),
        ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, "cuDNN's windows give"),
        ({"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, "cuDNN.s windows give"),
        ({"kernel_shape": [3, 3], "pads": [1, 1, 2, 2], "strides": [3, 3]}, "asymmetric padding"),
    ],
)
def test_a_max_pool_cudnn_pools_differently_is_refused_with_its_reason(attrs, why) -> None:  # type: ignore[no-untyped-def]
    from dsp_cuda_graphs.cudnn import pool_geometry

    with pytest.raises(Unsupported, match=why):
        pool_geometry((1, 2, 8, 8), "float32", **attrs)
