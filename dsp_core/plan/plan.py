"""The Plan: a flat, integer-indexed program compiled from a graph for a set of outputs.

Wiring is by integers. Every slot output is a *value* numbered from 0 in topological
order; a slot input ``r`` is either a value (``r >= 0``) or an external input
``-(k + 1)`` (``r < 0``, k indexes ``plan.externals``), or None for a missing optional
input. Executors hold one flat list: index 0 is None, then the externals, then the
values (see ``Plan.flat``).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsp_core.ops.registry import Trait
from dsp_core.runtime import epoch

Dim = int | str | None


class ExternalClass(enum.Enum):
    """How an external input behaves across calls."""

    CONSTANT = "constant"  # weights: fixed for the life of the plan
    VARIABLE = "variable"  # mutable state the caller owns (KV caches)
    PLACEHOLDER = "placeholder"  # fed at every call
    OUTER = "outer"  # a sub-plan's read of its enclosing plan's value (If/Loop/Scan bodies)


@dataclass(frozen=True)
class External:
    """An input of the plan that no slot computes."""

    name: str
    cls: ExternalClass
    dtype: str | None
    shape: tuple[Dim, ...] | None


@dataclass(frozen=True)
class Slot:
    """One op application: op, frozen attributes, integer wiring, traits."""

    index: int
    op: str
    domain: str
    opset: int
    name: str
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]  # value ids; None for an output the graph does not name
    attrs: Mapping[str, Any]
    traits: Trait


@dataclass(frozen=True)
class ValueInfo:
    """A value's name and what static inference knows of its dtype and shape."""

    name: str
    dtype: str | None
    shape: tuple[Dim, ...] | None


@dataclass(frozen=True)
class Region:
    """A control-flow slot's subgraphs, compiled into sub-plans (plan metadata).

    The slot's inputs are its node's inputs followed by one input per name in ``outer``:
    the enclosing values its sub-plans read, wired like any input so liveness keeps
    them alive until the slot has run.
    """

    slot: int
    kind: str  # the op: "If", "Loop", "Scan", ...
    subplans: dict[str, Plan]  # attribute name -> sub-plan
    outer: tuple[str, ...]  # names of the implicit inputs, in slot-input order


class ConstantTable(dict[int, np.ndarray]):
    """A plan's constants (external index -> array) that counts every change to its entries.

    A frozen plan snapshots its constants, and a step must reject a weight replaced since
    (``ConstantSnapshot.check_identity``). Comparing every constant's identity costs one
    lookup per weight on each replay; with ``version`` a replay compares one integer, and
    only a table that changed is checked entry by entry.
    """

    version = 0

    def _changed(self) -> None:
        self.version += 1
        epoch.bump()  # a bound step (IO binding) compares the process's epoch, not this count

    def __setitem__(self, key: int, value: np.ndarray) -> None:
        self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: int) -> None:
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> ConstantTable:  # type: ignore[override,misc]
        self._changed()
        return super().__ior__(other)  # type: ignore[no-any-return]

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``dict.update``, counted."""
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key: int, default: Any = None) -> Any:
        """``dict.setdefault``, counted."""
        self._changed()
        return super().setdefault(key, default)

    def pop(self, key: int, *default: Any) -> Any:
        """``dict.pop``, counted."""
        self._changed()
        return super().pop(key, *default)

    def popitem(self) -> tuple[int, np.ndarray]:
        """``dict.popitem``, counted."""
        self._changed()
        return super().popitem()

    def clear(self) -> None:
        """``dict.clear``, counted."""
        self._changed()
        super().clear()


@dataclass
class Plan:
    """A compiled, backend-neutral program for one graph and one set of requested outputs."""

    slots: tuple[Slot, ...]
    externals: tuple[External, ...]
    values: tuple[ValueInfo, ...]
    outputs: tuple[int, ...]  # refs (value id or external ref) of the requested outputs
    output_names: tuple[str, ...]
    release: tuple[tuple[int, ...], ...]  # per slot: value ids whose last use is that slot
    constants: dict[int, np.ndarray] = field(default_factory=ConstantTable)  # external index -> array
    content_hash: str = ""
    graph_name: str = "graph"
    regions: dict[int, Region] = field(default_factory=dict)  # slot index -> its sub-plans
    # external index -> constant_digest(constant): computed once, shared by the content
    # hash, DSP1's by-reference records and the disk cache's weight files.
    constant_digests: dict[int, bytes] = field(default_factory=dict)
    # Learned at freeze time, not part of the content hash: backend name -> {slot: reason}
    # for slots whose capture failed on that backend; they run as eager gaps between its
    # islands (dsp_core/runtime/islands.py). Kept in DSP1 so a disk-cached plan knows them.
    capture_gaps: dict[str, dict[int, str]] = field(default_factory=dict)
    # Set by the placement pass when the plan runs on more than one device: a
    # dsp_core.devices.execution.Placed (the Placement, the mover, the transfer recorder).
    # Not part of the content hash nor of DSP1: a model places its plan when it starts.
    placement: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.constants, ConstantTable):
            object.__setattr__(self, "constants", ConstantTable(self.constants))  # its first table

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "constants" and "constants" in self.__dict__:
            epoch.bump()  # a table replaced: no bound step (IO binding) may replay on the old one's weights
        object.__setattr__(self, name, value)

    def digest_of(self, k: int) -> bytes:
        """The digest of constant ``k`` (computed on first use)."""
        digest = self.constant_digests.get(k)
        if digest is None:
            digest = constant_digest(self.constants[k])
            self.constant_digests[k] = digest
        return digest

    # -- addressing ---------------------------------------------------------------
    @property
    def n_flat(self) -> int:
        """Length of an executor's flat value list (None cell + externals + values + scratch)."""
        return 1 + len(self.externals) + len(self.values) + 1

    @property
    def scratch(self) -> int:
        """Flat index that absorbs outputs nobody reads."""
        return self.n_flat - 1

    def flat(self, ref: int | None) -> int:
        """Flat index of a wiring reference (None -> 0, the always-None cell)."""
        if ref is None:
            return 0
        if ref < 0:
            return -ref  # external k (ref -(k+1)) lives at 1 + k
        return 1 + len(self.externals) + ref

    @staticmethod
    def external_ref(k: int) -> int:
        """The wiring reference of external input ``k``."""
        return -(k + 1)

    def ref_name(self, ref: int | None) -> str:
        """The graph name behind a reference, for tables and messages."""
        if ref is None:
            return ""
        if ref < 0:
            return self.externals[-ref - 1].name
        return self.values[ref].name

    def ref_info(self, ref: int | None) -> tuple[str | None, tuple[Dim, ...] | None]:
        """(dtype, shape) known statically for a reference."""
        if ref is None:
            return (None, None)
        if ref < 0:
            ext = self.externals[-ref - 1]
            return (ext.dtype, ext.shape)
        info = self.values[ref]
        return (info.dtype, info.shape)

    def is_constant(self, ref: int | None) -> bool:
        """True when ``ref`` is a CONSTANT external (a weight), not a fed, variable or computed value."""
        return ref is not None and ref < 0 and self.externals[-ref - 1].cls is ExternalClass.CONSTANT

    def placeholders(self) -> list[int]:
        """Indexes of PLACEHOLDER and VARIABLE externals (what a caller feeds)."""
        return [k for k, e in enumerate(self.externals) if e.cls is not ExternalClass.CONSTANT]

    def summary(self) -> dict[str, Any]:
        """Counts for reports: slots, values, externals by class, constant bytes."""
        by_cls = {c.value: sum(1 for e in self.externals if e.cls is c) for c in ExternalClass}
        return {
            "slots": len(self.slots),
            "values": len(self.values),
            "regions": {
                r.slot: {"op": r.kind, "subplans": {a: len(p.slots) for a, p in r.subplans.items()}}
                for r in self.regions.values()
            },
            "externals": by_cls,
            "constant_bytes": int(sum(a.nbytes for a in self.constants.values())),
            "content_hash": self.content_hash,
        }


def constant_digest(array: np.ndarray) -> bytes:
    """16 bytes of SHA-256 over an array's C-order bytes (hardware-accelerated, no copy when contiguous)."""
    data = np.ascontiguousarray(array)
    buffer: Any = data.reshape(-1).view(np.uint8) if data.size else b""
    return hashlib.sha256(buffer).digest()[:16]


@dataclass(frozen=True)
class Segment:
    """A maximal run of consecutive slots given to one backend by the auction."""

    index: int
    backend: str
    mode: str
    slots: tuple[int, ...]
    # Fusion groups (dsp_core.plan.fusion), in the order they run; each group's slots in
    # plan order. Empty: no fusion, the slots run in plan order (every backend by default).
    groups: tuple[tuple[int, ...], ...] = ()
    # Threads per call of a native CPU runtime (ONNX Runtime, OpenVINO); 0: DSP_CPU_THREADS. The
    # measured auction sets fewer for a short segment that ran faster on fewer (Backend.threads_variants).
    threads: int = 0
