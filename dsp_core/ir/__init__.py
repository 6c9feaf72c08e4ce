"""DSP's graph IR, the builder API and the ONNX importer."""

from typing import Any

from dsp_core.ir.builder import GraphBuilder, Tensor
from dsp_core.ir.graph import Graph, Node, Value

__all__ = ["Graph", "GraphBuilder", "Node", "Tensor", "Value", "import_model", "load_model"]


def __getattr__(name: str) -> Any:
    """The importer on first use: it imports onnx, which a warm start from the disk cache never needs."""
    if name in ("import_model", "load_model"):
        from dsp_core.ir import onnx_import

        return getattr(onnx_import, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
