"""DSP's graph IR, the builder API and the ONNX importer."""

from dsp_core.ir.builder import GraphBuilder, Tensor
from dsp_core.ir.graph import Graph, Node, Value
from dsp_core.ir.onnx_import import import_model, load_model

__all__ = ["Graph", "GraphBuilder", "Node", "Tensor", "Value", "import_model", "load_model"]
