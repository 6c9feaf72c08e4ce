"""The backend contract: the Backend base class, its static records, and compiled segments.

A backend declares once what it is (modes, platform, ModeContract, CaptureProfile) and
answers three questions: is it available, does it support this slot, what would this
segment cost. The core drives everything else through the template methods below: the
public method checks and records, the backend writes only the underscored part.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dsp_core.backends.guard import BackendFault, call_with_timeout, describe
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import BackendError, BackendUnavailableError

if TYPE_CHECKING:
    from dsp_core.plan.fusion import FusionPolicy
    from dsp_core.plan.plan import Plan, Segment


@dataclass(frozen=True)
class ModeContract:
    """What a backend promises about the outputs and buffers of the segments it runs."""

    deterministic: bool  # bit-equal outputs across runs on the same inputs
    needs_stable_addresses: bool  # replay bakes buffer addresses
    can_update_in_place: bool  # argument refresh without recapture
    tf32: bool  # reduced-precision matmul allowed
    dtypes: frozenset[str]  # dtypes it computes with
    tolerance: float  # max relative error vs the reference it promises
    computes_values: bool = True  # False: outputs carry the right shapes and dtypes only


def disagreement(got: Any, want: Any, tolerance: float) -> str | None:
    """Why ``got`` does not agree with ``want`` (host arrays of one output) within ``tolerance``, or None.

    Floats (and ml_dtypes' bfloat16) agree when their NaNs and infinities are where ``want``'s are and
    their largest absolute error is at most ``tolerance`` times ``want``'s largest finite magnitude
    (1 at least): a contract's tolerance, read against the output's own scale. Other dtypes agree
    when equal. Two backends' outputs on the same inputs (the replay contest's rivals) and a fused
    kernel's against the reference's (dsp-cuda-graphs, dsp-nvrtc) are held to this rule; the
    conformance kit holds a backend to the reference element by element (its ``_compare``)."""
    x, y = np.asarray(got), np.asarray(want)
    if x.shape != y.shape:
        return f"shape {list(x.shape)}, expected {list(y.shape)}"
    if y.dtype.kind not in "fc" and y.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 is of kind "V"
        if not np.array_equal(x, y):
            return f"{int(np.sum(x != y))} of {x.size} elements differ"
        return None
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    if not np.array_equal(np.isnan(xf), np.isnan(yf)):
        return "NaNs in other places"
    finite = np.isfinite(yf)
    special = ~finite & ~np.isnan(yf)
    if not np.array_equal(xf[special], yf[special]):
        return "infinities differ"
    if finite.any():
        err = float(np.max(np.abs(xf[finite] - yf[finite])))
        scale = max(1.0, float(np.max(np.abs(yf[finite]))))
        if not err <= tolerance * scale:  # NaN in got where want is finite: a disagreement too
            return f"max abs error {err:.3g} > {tolerance:g} x {scale:.3g}"
    return None


@dataclass(frozen=True)
class CaptureProfile:
    """How a capturing backend splits a segment into captured islands and eager gaps."""

    max_island_nodes: int | None = None  # None: no limit
    excluded_ops: frozenset[str] = frozenset()  # ops that always run in a gap


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, a human reason."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Availability:
        """Available."""
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> Availability:
        """Unavailable, with the reason a user should read."""
        return cls(False, reason)


class DeclineReason(enum.Enum):
    """Why a backend declined a slot: typed, so reports can count and group them."""

    UNSUPPORTED_OP = "unsupported_op"
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    UNSUPPORTED_ATTRIBUTE = "unsupported_attribute"
    DYNAMIC_SHAPE = "dynamic_shape"
    CONTROL_FLOW = "control_flow"
    UNAVAILABLE = "unavailable"
    BACKEND_FAULT = "backend_fault"  # its hook raised or answered off-contract: recorded, never fatal
    OTHER = "other"


@dataclass(frozen=True)
class Decline:
    """A backend's 'no' for one slot, with its typed reason and a detail for humans."""

    reason: DeclineReason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


@dataclass(frozen=True)
class SlotView:
    """What a backend sees of a slot when asked whether it supports it."""

    index: int
    op: str
    domain: str
    traits: Any  # ops.registry.Trait
    attrs: dict[str, Any]
    input_dtypes: tuple[str | None, ...]
    output_dtypes: tuple[str | None, ...]
    opset: int = 0  # the opset of the slot's domain in its model (0: unknown)


class ReplayStatus(enum.Enum):
    """What a replay reports back to the core."""

    OK = "ok"
    STALE_BUFFER = "stale_buffer"  # a buffer the recording reads was replaced: re-stage, re-dispatch once


class CaptureFailed(BackendError):
    """A capture could not be made.

    ``slot`` is the plan slot that made it fail, when the backend knows it (the kernel that
    raised, the host transfer or sync it issued). The core then captures the rest of the
    unit as islands around that slot (an eager gap); without it the core bisects the unit
    to find the slots (dsp_core/runtime/islands.py). A one-slot unit that fails runs
    eagerly for good (FAILED).
    """

    def __init__(self, message: str, slot: int | None = None) -> None:
        super().__init__(message)
        self.slot = slot


class CaptureOutOfMemory(BackendError):
    """A capture ran out of memory; the segment is OOM_DEFERRED and retried later."""


class CompiledSegment:
    """A segment made ready to run by a backend; the core drives its lifecycle.

    Every method works on the executor's flat value list ``values``: index 0 holds None
    (a missing optional input), then the plan's externals, then the slots' values.

    - ``run(values)``: execute the slots eagerly (SLOT_BY_SLOT semantics); always available.
    - ``warm(values)``: the first run after freezing; buffers materialise (default: ``run``).
    - ``prepare(values)``: plan the buffers a capture will bake in (the lifecycle's compile).
    - ``capture(values)``: record the segment against the buffers now in ``values``.
    - ``replay(values)``: run the recording; writes the segment's outputs into ``values``.
    - ``refresh(values, changed)``: patch the recording's arguments in place; False = recapture.
    - ``release()``: free buffers and recordings.

    Public methods are the base class's; a backend overrides the underscored ones.
    """

    def __init__(self, backend: Backend, segment: Segment) -> None:
        self.backend = backend
        self.segment = segment

    def run(self, values: list[Any]) -> None:
        """Execute the segment once, eagerly."""
        raise NotImplementedError

    def warm(self, values: list[Any]) -> None:
        """The warm-up run after freezing."""
        self._warm(values)

    def _warm(self, values: list[Any]) -> None:
        self.run(values)

    def prepare(self, values: list[Any]) -> None:
        """Plan and allocate what the capture will use."""
        self._prepare(values)

    def _prepare(self, values: list[Any]) -> None:
        raise CaptureFailed(f"backend {self.backend.name} does not capture")

    def capture(self, values: list[Any]) -> None:
        """Record the segment against the buffers in ``values``."""
        self._capture(values)

    def _capture(self, values: list[Any]) -> None:
        raise CaptureFailed(f"backend {self.backend.name} does not capture")

    def replay(self, values: list[Any]) -> ReplayStatus:
        """Run the recording; its outputs land in ``values``."""
        return self._replay(values)

    def _replay(self, values: list[Any]) -> ReplayStatus:
        raise CaptureFailed(f"backend {self.backend.name} does not replay")

    def replay_call(self, values: list[Any]) -> Callable[[], Any] | None:
        """A zero-argument call that replays the recording on the buffers now in ``values``, or None.

        The core's steady replay (every unit replaying, nothing able to move) calls it in
        place of ``replay``, for as long as the recording and ``values`` stay as they
        are: the call reads the same inputs and writes the outputs ``replay`` put in
        ``values``. None (the default) keeps ``replay``.
        """
        return self._replay_call(values)

    def _replay_call(self, values: list[Any]) -> Callable[[], Any] | None:
        return None

    def rival_call(self, values: list[Any], holder: CompiledSegment) -> Callable[[], Any] | None:
        """A zero-argument call that runs this segment on the inputs in ``values`` and writes
        ``holder``'s replay outputs in place, or None where this segment cannot.

        ``holder`` is another backend's (or thread count's) compiled segment of the same slots,
        replaying on ``values``; the core's replay contest (``dsp_core.runtime.contest``) runs the
        two calls in turns while the plan replays and keeps the faster. None (the default) keeps
        the segment out of contests.
        """
        return self._rival_call(values, holder)

    def _rival_call(self, values: list[Any], holder: CompiledSegment) -> Callable[[], Any] | None:
        return None

    def refresh(self, values: list[Any], changed: list[int]) -> bool:
        """Patch the recording for the inputs at flat indexes ``changed``; False means recapture."""
        if not self.backend.contract.can_update_in_place:
            return False
        return self._refresh(values, changed)

    def _refresh(self, values: list[Any], changed: list[int]) -> bool:
        return False

    def release(self) -> None:
        """Free whatever the segment holds (buffers, recordings)."""
        self._release()

    def _release(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        """Bytes of buffers this segment holds (for the plan cache's memory budget)."""
        return 0

    @property
    def settle_s(self) -> float:
        """Seconds this segment's runtime keeps cores busy after a run returns (pool threads
        spinning for the next call): the auction's trial waits this long after the segment's
        burst before it times another candidate, which those threads would otherwise slow."""
        return 0.0


class Backend:
    """One execution mode of a plugin. Subclasses set the class attributes and the _methods."""

    name: ClassVar[str]
    mode: ClassVar[GraphExecutionMode]
    platform: ClassVar[str]  # "cpu", "cuda", ...
    contract: ClassVar[ModeContract]
    profile: ClassVar[CaptureProfile] = CaptureProfile()
    # True for backends that capture and replay (their segments go through the lifecycle).
    captures: ClassVar[bool] = False
    # True for a backend that runs the reference's own kernels another way (numpy_replay): its
    # only claim is speed, so the measured auction times the reference against it too, and the
    # reference keeps a segment it runs as fast (dsp_core/backends/auction.py, contenders()).
    timed_against_reference: ClassVar[bool] = False
    # True for a CPU runtime whose compiled segment runs on ``Segment.threads`` threads (0: the
    # DSP_CPU_THREADS setting): where it wins a short segment, the measured auction times it at
    # fewer threads too and keeps the fastest (auction.THREADS_TRIAL_MAX_S).
    threads_variants: ClassVar[bool] = False
    # Set by discovery: which distribution registered this backend, and its version.
    distribution: str = "unknown"
    version: str = "unknown"

    def __init__(self) -> None:
        self._availability: Availability | None = None

    # -- availability ---------------------------------------------------------------
    def availability(self) -> Availability:
        """Whether this backend can run here (probed once, under DSP_PLUGIN_TIMEOUT, then remembered)."""
        if self._availability is None:
            what = f"backend {self.name}'s availability probe"
            try:
                answer = call_with_timeout(self._availability_probe, what)
                if not isinstance(answer, Availability):
                    raise BackendFault(f"{what} returned {type(answer).__name__}, not an Availability")
                self._availability = answer
            except BackendFault as exc:  # it hung, raised SystemExit, or answered off-contract
                self._availability = Availability.no(str(exc))
            except Exception as exc:  # noqa: BLE001  (a probe must never break discovery)
                self._availability = Availability.no(f"availability probe raised {describe(exc)}")
        return self._availability

    def _availability_probe(self) -> Availability:
        return Availability.yes()

    # -- the auction ----------------------------------------------------------------
    def supports(self, slot: SlotView) -> Decline | None:
        """None if this backend can run ``slot``, else a typed Decline."""
        if slot.op in self.profile.excluded_ops and not self._runs_excluded_ops_eagerly():
            return Decline(DeclineReason.UNSUPPORTED_OP, f"{slot.op} is excluded by {self.name}'s profile")
        bad = [d for d in slot.input_dtypes + slot.output_dtypes if d is not None and d not in self.contract.dtypes]
        if bad:
            return Decline(DeclineReason.UNSUPPORTED_DTYPE, f"{bad[0]} is not among {self.name}'s dtypes")
        try:
            answer = self._supports(slot)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001  (isolation: a raising predicate declines)
            return Decline(DeclineReason.BACKEND_FAULT, f"{self.name}._supports raised {describe(exc)}")
        if answer is not None and not isinstance(answer, Decline):
            return Decline(
                DeclineReason.BACKEND_FAULT,
                f"{self.name}._supports returned {type(answer).__name__} {answer!r}, not a Decline or None",
            )
        return answer

    def _runs_excluded_ops_eagerly(self) -> bool:
        return False

    def _supports(self, slot: SlotView) -> Decline | None:
        return None

    def segment_decline(self, segment: Segment, plan: Plan) -> Decline | None:
        """None to take ``segment`` as the auction cut it, else a Decline for all its slots.

        For what only the whole segment shows (a runtime whose per-call overhead exceeds
        what a short segment saves); the auction then gives those slots to the next backend.
        """
        return None

    def cost(self, segment: Segment, plan: Plan) -> float:
        """The bid for running ``segment``: lower wins among backends of equal rank."""
        return float(len(segment.slots))

    # -- lifecycle ------------------------------------------------------------------
    def compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        """Prepare ``segment`` of ``plan`` to run; checks availability, times the work."""
        avail = self.availability()
        if not avail.ok:
            raise BackendUnavailableError(f"backend {self.name} ({self.mode.name}) is unavailable: {avail.reason}")
        start = time.perf_counter()
        segment = self._grouped(plan, segment)
        try:
            if plan.placement is None:
                compiled = self._compile(plan, segment)
            else:  # a plan over several devices: compiled on the segment's device, run there
                from dsp_core.devices.execution import device_context

                with device_context(plan, segment):
                    compiled = self._compile(plan, segment)
        except BackendError:
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001  (SystemExit too: the caller falls back)
            span = f"slots {segment.slots[0]}..{segment.slots[-1]}" if segment.slots else "no slots"
            raise BackendFault(
                f"backend {self.name} failed to compile segment {segment.index} ({span}): {describe(exc)}"
            ) from exc
        if not isinstance(compiled, CompiledSegment):
            raise BackendFault(
                f"backend {self.name}._compile returned {type(compiled).__name__}, not a CompiledSegment"
            )
        compiled.compile_seconds = time.perf_counter() - start  # type: ignore[attr-defined]
        if plan.placement is not None:
            from dsp_core.devices.execution import wrap

            return wrap(plan, compiled)
        return compiled

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        raise NotImplementedError(f"backend {self.name} does not implement _compile")

    # -- fusion (dsp_core/plan/fusion.py, docs/fusion.md) --------------------------------
    def fusion_policy(self) -> FusionPolicy | None:
        """What this backend's templates can fuse (``merge_ok`` and template limits); None: no fusion.

        The core groups each segment it compiles with this policy (``Segment.groups``);
        ``dsp_core.plan.fusion.REFERENCE_POLICY`` describes the Triton templates of fusion.md.
        """
        return None

    def _grouped(self, plan: Plan, segment: Segment) -> Segment:
        """``segment`` with its fusion groups under this backend's policy (unchanged without one)."""
        if segment.groups or len(segment.slots) < 2:
            return segment
        try:
            policy = self.fusion_policy()
            if policy is None:
                return segment
            from dsp_core.plan.fusion import propose_groups

            groups = propose_groups(plan, segment.slots, policy).slot_groups()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001  (a broken policy: the compile fails, the next backend runs it)
            raise BackendFault(
                f"backend {self.name}'s fusion policy failed on segment {segment.index}: {describe(exc)}; "
                "fix its fusion_policy() or uninstall it"
            ) from exc
        return dataclasses.replace(segment, groups=groups)

    # -- device placement of fed inputs (used by dsp_core.runtime.staging) ---------------
    # A backend whose kernels read device memory overrides both: the core then stages the
    # placeholders that only its units read into buffers it allocates (one copy per step,
    # host to device, at a stable address). The defaults keep feeds on the host.
    def stage_buffer(self, value: Any) -> Any | None:
        """A stable buffer for fed array ``value`` where this backend reads it, or None (host)."""
        return None

    def stage_into(self, buffer: Any, value: Any) -> None:
        """Copy fed ``value`` into ``buffer`` (one made by ``stage_buffer``)."""
        buffer[...] = value

    def describe(self) -> dict[str, Any]:
        """A JSON-able record of this backend for `dsp backends list`."""
        avail = self.availability()
        return {
            "name": self.name,
            "mode": self.mode.name,
            "platform": self.platform,
            "distribution": self.distribution,
            "version": self.version,
            "available": avail.ok,
            "reason": avail.reason,
            "contract": {
                "deterministic": self.contract.deterministic,
                "needs_stable_addresses": self.contract.needs_stable_addresses,
                "can_update_in_place": self.contract.can_update_in_place,
                "tf32": self.contract.tf32,
                "dtypes": sorted(self.contract.dtypes),
                "tolerance": self.contract.tolerance,
                "computes_values": self.contract.computes_values,
            },
        }


@dataclass
class LoadFailure:
    """A plugin that could not be loaded or registered, and why."""

    entry_point: str
    distribution: str
    error: str
    stage: str  # "import", "register", "hook"


@dataclass
class Registry:
    """The outcome of discovery: loaded backends and the plugins that failed."""

    backends: list[Backend] = field(default_factory=list)
    failures: list[LoadFailure] = field(default_factory=list)

    def for_mode(self, mode: GraphExecutionMode) -> list[Backend]:
        """Backends serving ``mode``, in discovery order."""
        return [b for b in self.backends if b.mode is mode]
