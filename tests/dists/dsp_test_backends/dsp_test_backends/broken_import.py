"""A plugin whose import fails: discovery must record it and load the others."""

raise ImportError("dsp_test_backends.broken_import fails on purpose")
