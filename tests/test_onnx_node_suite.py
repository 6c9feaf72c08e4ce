"""ONNX's node conformance suite through dsp_core.onnx_backend.

Every case of onnx's node suite runs on its stored inputs and is compared with its stored
outputs at its own tolerance, except the cases listed (each with a reason) in
tests/conformance/exclusions.py. A failure here is a wrong kernel, never a timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from conformance.exclusions import EXCLUDED  # noqa: E402
from node_suite import load_cases, run_case  # noqa: E402

CASES = load_cases()
BY_NAME = {c.name: c for c in CASES}


@pytest.mark.parametrize("name", [c.name for c in CASES if c.name not in EXCLUDED])
def test_node_case(name: str) -> None:
    run_case(BY_NAME[name])


def test_exclusions_are_real_cases_with_reasons() -> None:
    stale = sorted(set(EXCLUDED) - set(BY_NAME))
    assert not stale, f"exclusions name cases the suite does not have: {stale[:10]}"
    assert all(reason.strip() for reason in EXCLUDED.values())
