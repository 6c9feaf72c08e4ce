"""``test_capture_faults`` (mode VULKAN): a capturing backend whose captures fail on demand.

It is EMULATED_REPLAY (cpu_ref's numpy capture/replay) with faults injected, so the
core's OOM_DEFERRED and FAILED paths run against a real backend:

- the first K capture attempts of each segment raise ``CaptureOutOfMemory``
  (K = ``DSP_TEST_CAPTURE_OOM``, else the class attribute ``oom_attempts``), in
  ``prepare`` or, with ``DSP_TEST_CAPTURE_OOM_AT=capture``, in ``capture``;
- a segment holding an op named in ``DSP_TEST_CAPTURE_FAIL_OPS`` (comma-separated, else
  the class attribute ``fail_ops``) raises ``CaptureFailed`` when captured.

Its profile excludes Sigmoid (run eagerly, in a gap), so one segment gives several islands.
VULKAN is in no AUTO fallback chain, so this backend never changes what AUTO picks; it is
available only with DSP_TEST_BACKENDS=1.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from dsp_cpu_ref.emulated import EmulatedSegment

from dsp_core import hookimpl
from dsp_core.backends.base import (
    Availability,
    Backend,
    CaptureFailed,
    CaptureOutOfMemory,
    CaptureProfile,
    CompiledSegment,
    ModeContract,
)
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ir.dtypes import DTYPE_NAMES
from dsp_core.plan.plan import Plan, Segment


class FaultySegment(EmulatedSegment):
    """An emulated-replay segment whose prepare/capture fail as configured."""

    oom_attempts: ClassVar[int] = 0  # capture attempts (per segment) that run out of memory
    fail_ops: ClassVar[frozenset[str]] = frozenset()  # ops whose segments fail to capture

    def __init__(self, backend: Backend, plan: Plan, segment: Segment) -> None:
        super().__init__(backend, plan, segment)
        self.ops = frozenset(plan.slots[s].op for s in segment.slots)
        self.attempts = 0  # capture attempts so far (a prepare, or a capture after CAPTURE_PENDING)

    def _oom_limit(self) -> int:
        return int(os.environ.get("DSP_TEST_CAPTURE_OOM", self.oom_attempts))

    def _failing_ops(self) -> frozenset[str]:
        raw = os.environ.get("DSP_TEST_CAPTURE_FAIL_OPS")
        return frozenset(filter(None, raw.split(","))) if raw is not None else self.fail_ops

    def _maybe_oom(self, stage: str) -> None:
        if os.environ.get("DSP_TEST_CAPTURE_OOM_AT", "prepare") != stage:
            return
        self.attempts += 1
        if self.attempts <= self._oom_limit():
            raise CaptureOutOfMemory(f"injected out-of-memory at {stage} attempt {self.attempts}")

    def _prepare(self, values: list[Any]) -> None:
        self._maybe_oom("prepare")
        super()._prepare(values)

    def _capture(self, values: list[Any]) -> None:
        bad = sorted(self.ops & self._failing_ops())
        if bad:
            raise CaptureFailed(f"injected capture failure: segment holds {', '.join(bad)}")
        self._maybe_oom("capture")
        super()._capture(values)


class CaptureFaultsBackend(Backend):
    """Emulated capture/replay with injected out-of-memory and capture failures."""

    name = "test_capture_faults"
    mode = GraphExecutionMode.VULKAN
    platform = "cpu"
    captures = True
    contract = ModeContract(
        deterministic=True,
        needs_stable_addresses=True,
        can_update_in_place=False,
        tf32=False,
        dtypes=frozenset(DTYPE_NAMES),
        tolerance=0.0,
    )
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=frozenset({"Sigmoid"}))

    def _availability_probe(self) -> Availability:
        if os.environ.get("DSP_TEST_BACKENDS") == "1":
            return Availability.yes()
        return Availability.no("test backend: set DSP_TEST_BACKENDS=1 to enable")

    def _runs_excluded_ops_eagerly(self) -> bool:
        return True  # Sigmoid runs in a gap between islands, not on another backend

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        return FaultySegment(self, plan, segment)


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """The fault-injecting capturing backend."""
    return [CaptureFaultsBackend()]
