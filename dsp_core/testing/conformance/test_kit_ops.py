"""Op cases: every graph of the kit, run by the backend under test, equals the reference."""

from __future__ import annotations

import numpy as np
import pytest

from dsp_core.backends.base import Backend
from dsp_core.testing.conformance.cases import CASES, Case
from dsp_core.testing.conformance.helpers import assert_matches, compile_for, reference, require_backend_ran

RUNS = 3  # fresh inputs each run


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_op_case_matches_reference(dsp_backend: Backend, dsp_rng: np.random.Generator, case: Case) -> None:
    """Outputs within the contract's tolerance of SLOT_BY_SLOT (shapes and dtypes only if no values)."""
    graph = case.build()
    model = compile_for(dsp_backend, graph)
    require_backend_ran(dsp_backend, model, f"case {case.name}")
    ref = reference(graph)
    for run in range(RUNS):
        feeds = case.feeds(dsp_rng)
        assert_matches(dsp_backend, model.run(feeds), ref.run(feeds), f"case {case.name}, run {run + 1}", model)
