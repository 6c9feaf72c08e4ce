"""Special functions (erf, ...) for reference kernels: scipy.special on numpy, cupyx.scipy.special on CuPy.

Both are compiled ufuncs, so a kernel applies them to a whole array in one call, on the
device where the array lives: nothing goes through the host inside a captured segment.
scipy is a dependency of dsp-core; it is imported on first use, so a process that never
computes a special function never loads it, and one that does without scipy installed
gets an error that says what to install.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from dsp_core.errors import DSPError


class MissingDependencyError(DSPError):
    """A library a kernel needs is not installed; the message says what to install."""


def is_cupy(xp: Any) -> bool:
    """True when ``xp`` is CuPy (or a backend's wrapper of it, which forwards ``__name__``)."""
    return str(getattr(xp, "__name__", "")).split(".")[0] == "cupy"


def special(xp: Any) -> ModuleType:
    """The ``scipy.special`` module that computes on ``xp``'s arrays."""
    return _cupyx_special() if is_cupy(xp) else _scipy_special()


@functools.cache
def _scipy_special() -> ModuleType:
    try:
        import scipy.special
    except ImportError as exc:
        raise MissingDependencyError(
            f"scipy is needed for special functions (Erf, Gelu) on the CPU and could not be imported ({exc}): "
            "pip install 'scipy>=1.11,<2' (a dependency of dsp-core)"
        ) from exc
    return scipy.special


@functools.cache
def _cupyx_special() -> ModuleType:
    import cupyx.scipy.special

    return cupyx.scipy.special


def erf(xp: Any, x: Any) -> Any:
    """erf(x) elementwise, in the dtype of ``x`` (float32 or float64)."""
    return special(xp).erf(x)
