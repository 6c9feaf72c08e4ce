"""A plugin whose import misbehaves when DSP_TEST_FAULT selects it; otherwise it provides nothing.

- ``import_systemexit``: the module calls ``sys.exit`` while being imported.
- ``import_hang``: the import never returns.
Discovery must record either as a load failure and load every other plugin.
"""

import os
import sys
import threading

from dsp_core import hookimpl

if os.environ.get("DSP_TEST_FAULT") == "import_systemexit":
    sys.exit(3)
if os.environ.get("DSP_TEST_FAULT") == "import_hang":
    threading.Event().wait()  # never set


@hookimpl
def dsp_register_backends() -> list[object]:
    """Nothing: this plugin exists for its import."""
    return []
