"""A plugin whose registration hook raises: discovery must record it and go on."""

from dsp_core import hookimpl


@hookimpl
def dsp_register_backends() -> list[object]:
    """Raises on purpose."""
    raise RuntimeError("dsp_test_backends.broken_hook fails on purpose")
