"""Arrays a generated kernel reads in place of constant inputs (dsp-triton's and dsp-nvrtc's products).

A product whose weight is a constant reads it in the layout its kernel streams best: a [K, N]
weight as a contiguous [N, K] copy, the weights of merged sibling products joined into one
matrix, their biases into one vector. Each is made once from the constants (outside any
capture, from CuPy's default pool, the stream synchronised after: a kernel that loads its
weights before waiting for the kernel before it must find them complete) and again only when
a constant it was made from moves (``addresses``); the originals stay for the reference kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Derived:
    """An array a kernel reads instead of (or besides) its inputs, made once from constant ones."""

    sources: tuple[int, ...]  # the input flats it is made from
    addresses: tuple[int, ...]  # their device addresses when it was made
    build: Callable[[Any, list[Any]], Any]
    array: Any

    @staticmethod
    def make(cp: Any, flats: tuple[int, ...], arrays: list[Any], build: Callable[[Any, list[Any]], Any]) -> Derived:
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            got = build(cp, arrays)
        cp.cuda.get_current_stream().synchronize()
        return Derived(flats, tuple(int(x.data.ptr) for x in arrays), build, got)

    def moved(self, arrays: list[Any]) -> bool:
        """True when a source is no longer where it was when this was made."""
        return tuple(int(x.data.ptr) for x in arrays) != self.addresses


def nk_copy(cp: Any, weights: list[Any]) -> Any:
    """A [K, N] weight as a [K, N] view of a contiguous [N, K] copy: K is then its unit stride."""
    return cp.ascontiguousarray(weights[0].T).T


def joined_nk(trans_b: bool) -> Callable[[Any, list[Any]], Any]:
    """Merged products' weights ([K, N_i], or [N_i, K] transposed) joined as one contiguous [sum N_i, K]."""

    def build(cp: Any, weights: list[Any]) -> Any:
        return cp.ascontiguousarray(cp.concatenate([w if trans_b else w.T for w in weights], axis=0))

    return build


def joined_bias(cp: Any, biases: list[Any]) -> Any:
    """Merged Gemms' biases ([N_i] or [1, N_i]) joined along their last axis."""
    return cp.ascontiguousarray(cp.concatenate(biases, axis=-1))
