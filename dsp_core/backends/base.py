"""The backend contract: the Backend base class, its static records, and compiled segments.

A backend declares once what it is (modes, platform, ModeContract, CaptureProfile) and
answers three questions: is it available, does it support this slot, what would this
segment cost. The core drives everything else through the template methods below: the
public method checks and records, the backend writes only the underscored part.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.errors import BackendError, BackendUnavailableError

if TYPE_CHECKING:
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


class CompiledSegment:
    """A segment made ready to run by a backend.

    ``run(values)`` executes the segment's slots in order, reading inputs from and
    writing outputs into the executor's flat value list (index 0 holds None for missing
    optional inputs, then the plan's external inputs, then the slots' output values),
    and clearing values at their last use.
    """

    def __init__(self, backend: Backend, segment: Segment) -> None:
        self.backend = backend
        self.segment = segment

    def run(self, values: list[Any]) -> None:
        """Execute the segment once."""
        raise NotImplementedError

    def release(self) -> None:
        """Free whatever the segment holds (buffers, recordings)."""


class Backend:
    """One execution mode of a plugin. Subclasses set the class attributes and the _methods."""

    name: ClassVar[str]
    mode: ClassVar[GraphExecutionMode]
    platform: ClassVar[str]  # "cpu", "cuda", ...
    contract: ClassVar[ModeContract]
    profile: ClassVar[CaptureProfile] = CaptureProfile()
    # Set by discovery: which distribution registered this backend, and its version.
    distribution: str = "unknown"
    version: str = "unknown"

    def __init__(self) -> None:
        self._availability: Availability | None = None

    # -- availability ---------------------------------------------------------------
    def availability(self) -> Availability:
        """Whether this backend can run here (probed once, then remembered)."""
        if self._availability is None:
            try:
                self._availability = self._availability_probe()
            except Exception as exc:  # noqa: BLE001  (a probe must never break discovery)
                self._availability = Availability.no(f"availability probe raised {type(exc).__name__}: {exc}")
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
        return self._supports(slot)

    def _runs_excluded_ops_eagerly(self) -> bool:
        return False

    def _supports(self, slot: SlotView) -> Decline | None:
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
        try:
            compiled = self._compile(plan, segment)
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(
                f"backend {self.name} failed to compile segment {segment.index} "
                f"(slots {segment.slots[0]}..{segment.slots[-1]}): {type(exc).__name__}: {exc}"
            ) from exc
        compiled.compile_seconds = time.perf_counter() - start  # type: ignore[attr-defined]
        return compiled

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        raise NotImplementedError(f"backend {self.name} does not implement _compile")

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
