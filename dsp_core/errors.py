"""DSP's exception hierarchy: every error a user can cause or meet is a DSPError.

Each message names the culprit (which node, input, file or backend), says what was
expected and what was got, and where it can, the remedy.
"""

from __future__ import annotations


class DSPError(Exception):
    """Base class of every error DSP raises on purpose."""


class ModelLoadError(DSPError):
    """A model file or proto could not be read (missing, truncated, not ONNX)."""


class UnsupportedOpError(DSPError):
    """A node uses an op (or an op version) that DSP does not implement."""


class GraphError(DSPError):
    """The graph is malformed: a dangling value, a cycle, a duplicate name."""


class DTypeError(DSPError):
    """A dtype that DSP does not support, or a mismatch between dtypes."""


class InputError(DSPError):
    """Bad feeds at run time: unknown or missing input name, wrong shape or dtype."""


class ShapeError(DSPError):
    """Shape inference found shapes that cannot work together."""


class KernelError(DSPError):
    """A reference kernel failed on its inputs; the message names the node."""


class BackendError(DSPError):
    """A backend could not be found, loaded or used."""


class BackendUnavailableError(BackendError):
    """The requested execution mode has no available backend; says which one to install."""


class PlanDeclinedError(DSPError):
    """The plan compiler declined a graph (raised only when a strict plan was asked for)."""


class PlanFormatError(DSPError):
    """A serialized plan (DSP1) is malformed or corrupt, or no longer matches this build."""


class ConfigError(DSPError):
    """An option was given a value outside its allowed set."""
