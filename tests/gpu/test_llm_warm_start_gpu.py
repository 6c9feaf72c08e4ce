"""A GenerationPipeline's warm start on the GPU: a second process reuses the prefill, decode and block plans.

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
    # metadata, prefill, decode, greedy and sampled blocks
    assert warm["warm"]["hits"] == 5 and warm["warm"]["graph_imports"] == 0 and warm["warm"]["rewrites"] == 0
    assert cold["prefill_shape"] == warm["prefill_shape"] == [1, 1, 1000]
    assert warm["block_counters"]["captures"] == cold["block_counters"]["captures"] == 1


def _kernel_files(cache: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file in the kernel caches: dsp-triton's binaries and tuning choices
    (<cache>/triton), CuPy's kernels and Triton's own builds (the dirs the test points them at)."""
    found = {}
    for sub in ("triton", "cupy", "triton-default"):
        for p in sorted((cache / sub).rglob("*")):
            if p.is_file():
                st = p.stat()
                found[str(p.relative_to(cache))] = (st.st_ino, st.st_mtime_ns)
    return found


@pytest.mark.parametrize("name", ["gpt2_eager", "llama_eager"])
def test_a_second_process_compiles_and_tunes_no_kernel_in_triton(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every kernel binary and tuning choice of the cold process is reused as it is: the warm one writes none,
    and loads the cubins itself (no torch, no Triton compiler)."""
    try:
        import dsp_triton  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"dsp-triton or triton is not installed ({exc})")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cupy"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-default"))
    cold = run_child(tmp_path, name, mode="triton")
    kernels = _kernel_files(tmp_path)
    assert any(k.startswith("triton/bin/") for k in kernels), sorted(kernels)[:20]
    assert any(k.startswith("triton/cubin/") for k in kernels), sorted(kernels)[:20]
    assert "torch" in cold["imported"] and "triton.compiler.compiler" in cold["imported"]
    warm = run_child(tmp_path, name, mode="triton")
    want = [int(t) for t in np.load(FIXTURES / f"{name}.golden.npz")["greedy_tokens"]]
    assert cold["greedy"] == warm["greedy"] == [want]
    assert warm["calls"] == {} and warm["warm"]["hits"] == 5
    # every kernel came from DSP's cubin cache, loaded and launched without Triton's JIT: its
    # NVIDIA driver (which imports torch) and its compiler were never imported
    assert warm["imported"] == [], warm["imported"]
    after = _kernel_files(tmp_path)
    assert after == kernels, f"written by the warm process: {sorted(set(after.items()) - set(kernels.items()))[:20]}"
