"""A plugin whose registration hook raises (with DSP_TEST_BACKENDS=1): discovery must record it and go on."""

import os

from dsp_core import hookimpl


@hookimpl
def dsp_register_backends() -> list[object]:
    """Raises on purpose when the test backends are enabled; provides nothing otherwise."""
    if os.environ.get("DSP_TEST_BACKENDS") == "1":
        raise RuntimeError("dsp_test_backends.broken_hook fails on purpose")
    return []
