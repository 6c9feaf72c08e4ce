"""A GenerationPipeline's warm start on the GPU: a second process reuses the decode and block plans.

The same two-process check as tests/test_llm_warm_start.py, in CUDA_GRAPHS: the warm
process imports no graph, rewrites nothing, compiles no plan, and its cached plans give
the cold process's tokens (torch's, greedy) and capture as the built ones do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_llm_warm_start import run_child

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_a_second_process_reuses_the_plans_in_cuda_graphs(tmp_path: Path, name: str) -> None:
    cold = run_child(tmp_path, name, mode="cuda_graphs")
    warm = run_child(tmp_path, name, mode="cuda_graphs")
    want = [int(t) for t in np.load(FIXTURES / f"{name}.golden.npz")["greedy_tokens"]]
    assert cold["greedy"] == warm["greedy"] == [want]
    assert cold["sampled"] == warm["sampled"]
    assert warm["calls"] == {}
    assert warm["warm"]["hits"] == 4 and warm["warm"]["graph_imports"] == 0 and warm["warm"]["rewrites"] == 0
    assert warm["block_counters"]["captures"] == cold["block_counters"]["captures"] == 1
