"""ONNX node conformance cases DSP does not run, each with its reason.

This is the one list of exclusions; scripts/node_suite.py and tests/test_onnx_node_suite.py
read it. Keep it short: an exclusion is the exception, and each says why.
"""

from __future__ import annotations

EXCLUDED: dict[str, str] = {}
