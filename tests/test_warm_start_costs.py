"""What every start pays, cold or warm, kept to what it needs (docs/cache.md, "A GenerationPipeline's warm start")."""

from __future__ import annotations

import pytest

from dsp_core.backends import auction, discovery
from dsp_core.backends.base import Availability, Backend, ModeContract, Registry
from dsp_core.backends.modes import GraphExecutionMode


class _Probed(Backend):
    """A CPU backend whose availability probe is counted (a real one may import a whole runtime)."""

    name = "probed_cpu_runtime"
    mode = GraphExecutionMode.OPENVINO
    platform = "cpu"
    contract = ModeContract(
        deterministic=True,
        needs_stable_addresses=False,
        can_update_in_place=False,
        tf32=False,
        dtypes=frozenset({"float32"}),
        tolerance=0.0,
    )

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    def _availability_probe(self) -> Availability:
        self.probes += 1
        return Availability.yes()


@pytest.mark.parametrize("excluded", [True, False])
def test_auto_does_not_probe_a_backend_it_leaves_out(monkeypatch: pytest.MonkeyPatch, excluded: bool) -> None:
    probed = _Probed()
    registry = Registry([*discovery.discover().backends, probed])
    monkeypatch.setenv("DSP_AUTO_EXCLUDE", f"{probed.name},openvino,onnxruntime" if excluded else "none")
    chain, _ = auction.candidates(registry, GraphExecutionMode.AUTO)
    assert (probed in chain) is not excluded
    assert probed.probes == (0 if excluded else 1)
