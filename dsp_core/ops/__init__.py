"""The op table's families; importing this package registers every op.

One module per family, each op's schema, traits, shape rule and kernel side by side.
"""

from dsp_core.ops import (  # noqa: F401  (registration by import)
    control,
    conv,
    elementwise,
    linalg,
    llm,
    losses,
    ml,
    random,
    recurrent,
    sequence,
    tensor,
)
from dsp_core.ops.registry import OpDef, Trait, all_ops, has_op, lookup, op

__all__ = ["OpDef", "Trait", "all_ops", "has_op", "lookup", "op"]
