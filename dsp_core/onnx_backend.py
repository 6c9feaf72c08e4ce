"""TEMPORARY development runner (replaced by the real backend): interprets an ONNX model node by node."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dsp_core.ops.registry import KernelContext, lookup


def _attr(a: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(a)
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode() for x in v]
    if isinstance(v, list) and v and isinstance(v[0], onnx.TensorProto):
        return [numpy_helper.to_array(x) for x in v]
    return v


class _Rep:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.opsets = {o.domain: o.version for o in model.opset_import}

    def run(self, inputs: Any, **kwargs: Any) -> list[Any]:
        g = self.model.graph
        env: dict[str, Any] = {"": None}
        for t in g.initializer:
            env[t.name] = numpy_helper.to_array(t)
        names = [i.name for i in g.input if i.name not in env]
        for n, x in zip(names, inputs):
            env[n] = x
        for node in g.node:
            opdef = lookup(node.op_type, node.domain)
            attrs = {a.name: _attr(a) for a in node.attribute}
            ctx = KernelContext(np, self.opsets.get(node.domain or "", 1), len(node.input), len(node.output), node.name)
            res = opdef.kernel(ctx, *[env[i] for i in node.input], **attrs)
            if opdef.single_output:
                res = (res,)
            for name, r in zip(node.output, res):
                if name:
                    env[name] = r
        return [env[o.name] for o in g.output]


def prepare(model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> _Rep:
    return _Rep(model)
