"""Placement: a compile-time pass that gives every slot (and every external) a device.

Strategies (``Strategy``):
- SINGLE_DEVICE: everything on device 0.
- MEMORY_FIT: slots in plan order fill device 0 until its budget is used, then spill to
  device 1, and so on (greedy). A device's budget is its free memory minus the reserve
  (DSP_DEVICE_MEMORY_RESERVE), capped by DSP_MAX_DEVICE_MEMORY.
- PIPELINE_PARALLEL: one contiguous stage per device; each cut lies where the weight
  bytes before it are near an equal share (within ``BALANCE`` of the share), and among
  those boundaries where the fewest activation bytes cross.
- CUSTOM: a map from name patterns (fnmatch, against a slot's node name or any of its
  output names) to devices; the first pattern that matches wins; a slot no pattern
  matches stays on the device of the slot before it (device 0 for the first).

Only when asked (``split_siblings=True`` or DSP_SPLIT_SIBLINGS=1), sibling products that
read one input are then spread over the devices (``split_sibling_products``).

Bytes: a constant's bytes are charged to the device of its first reader, and again to
every other device that reads it (it is replicated there once). Values computed only
from constants (sealed at freeze) count like constants. An activation's bytes come from
its static shape with every symbolic dimension counted as 1 (bytes per unit of batch and
sequence); the runtime's transfer records (dsp_core.devices.transfers) hold the bytes
actually copied.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dsp_core import config
from dsp_core.devices.topology import Topology
from dsp_core.errors import DSPError, InputError
from dsp_core.ir import dtypes
from dsp_core.ops.registry import Trait
from dsp_core.plan.fusion import sealed_slots
from dsp_core.plan.plan import Dim, Plan

# A pipeline cut may sit where the weights before it are within this fraction of one
# stage's share of the ideal position (0.25: a stage holds 0.5x to 1.5x of its share).
BALANCE = 0.25


class Strategy(enum.Enum):
    """How slots are given devices."""

    SINGLE_DEVICE = "single_device"
    MEMORY_FIT = "memory_fit"
    PIPELINE_PARALLEL = "pipeline_parallel"
    CUSTOM = "custom"


class PlacementError(DSPError):
    """A plan cannot be placed: a device cannot take its share, or the request is malformed."""


@dataclass(frozen=True)
class Cut:
    """A boundary between two consecutive slots on different devices, and what crosses it."""

    after: int  # the last slot before the boundary
    src: int  # device of that slot
    dst: int  # device of the slot after it
    values: tuple[int, ...]  # value ids produced before and read after (activations, per step)
    nbytes: int  # their modelled bytes (symbolic dims as 1)

    def as_dict(self, plan: Plan | None = None) -> dict[str, Any]:
        """JSON-able form (value names when the plan is given)."""
        names = [plan.values[v].name for v in self.values] if plan is not None else list(self.values)
        return {"after_slot": self.after, "src": self.src, "dst": self.dst, "values": names, "bytes": self.nbytes}


@dataclass(frozen=True, eq=False)
class Placement(Mapping[int, int]):
    """Slot index -> device index, with each external's home, the budgets, the cuts and the bytes.

    A Mapping over slots: ``placement[3]`` is slot 3's device, ``dict(placement)`` the whole map.
    """

    strategy: Strategy
    topology: Topology
    slots: tuple[int, ...]  # slot index -> device
    externals: tuple[int, ...]  # external index -> home: where its first reader of data (not shape) runs
    budgets: tuple[int, ...]  # per device: the bytes placement may put there
    weights: tuple[int, ...]  # per device: constant (and sealed) bytes resident there, replicas included
    replicas: Mapping[int, tuple[int, ...]]  # flat index of a constant/sealed value -> devices it is copied to
    cuts: tuple[Cut, ...]
    sealed: frozenset[int] = field(default=frozenset())

    def __getitem__(self, slot: int) -> int:
        return self.slots[slot]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.slots)))

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def devices_used(self) -> tuple[int, ...]:
        """The devices some slot runs on, in order."""
        return tuple(sorted(set(self.slots)))

    @property
    def multi_device(self) -> bool:
        """True when slots run on more than one device, or on a device other than 0 (copies are needed)."""
        return len(self.devices_used) > 1 or any(d != 0 for d in self.slots)

    def key(self, device: int) -> tuple[str, str]:
        """The device key (platform, capability) of ``device``."""
        return self.topology[device].key

    def as_dict(self, plan: Plan | None = None) -> dict[str, Any]:
        """JSON-able form: the strategy, per-device slots, bytes and budgets, the cuts."""
        per_device = []
        for d in range(len(self.topology)):
            mine = [s for s, dev in enumerate(self.slots) if dev == d]
            per_device.append(
                {
                    "device": d,
                    "key": list(self.key(d)),
                    "slots": [mine[0], mine[-1]] if mine else [],
                    "n_slots": len(mine),
                    "weight_bytes": self.weights[d],
                    "budget_bytes": self.budgets[d],
                }
            )
        return {
            "strategy": self.strategy.value,
            "topology": self.topology.as_dict(),
            "devices": per_device,
            "cuts": [c.as_dict(plan) for c in self.cuts],
            "cut_bytes": sum(c.nbytes for c in self.cuts),
            "replicated_bytes": self.replicated_bytes(plan) if plan is not None else None,
        }

    def replicated_bytes(self, plan: Plan) -> int:
        """Bytes of constants and sealed values copied to a device other than their home (once)."""
        sizes = _flat_sizes(plan)
        return sum(sizes.get(f, 0) * len(devs) for f, devs in self.replicas.items())


# -- bytes ------------------------------------------------------------------------------
def nbytes_of(dtype: str | None, shape: tuple[Dim, ...] | None) -> int:
    """Modelled bytes of a value: symbolic (or unknown) dims count as 1; unknown dtype or shape as 0."""
    if dtype is None or shape is None or dtype.startswith("unsupported:"):
        return 0
    try:
        itemsize = dtypes.to_numpy(dtype).itemsize
    except DSPError:
        return 0
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) and d >= 0 else 1
    return n * itemsize


def _flat_sizes(plan: Plan) -> dict[int, int]:
    """Flat index -> bytes: constants by their arrays, values by their static shapes."""
    sizes = {plan.flat(plan.external_ref(k)): int(a.nbytes) for k, a in plan.constants.items()}
    for v, info in enumerate(plan.values):
        sizes[plan.flat(v)] = nbytes_of(info.dtype, info.shape)
    return sizes


@dataclass
class _Bytes:
    """What each slot brings: the constant (and sealed) flats it reads or makes, and their sizes."""

    sizes: dict[int, int]
    sealed: frozenset[int]
    resident: list[tuple[int, ...]]  # per slot: flat indexes of constants/sealed values it reads or makes

    @classmethod
    def of(cls, plan: Plan) -> _Bytes:
        sizes = _flat_sizes(plan)
        sealed = frozenset(sealed_slots(plan))
        constant_flats = {plan.flat(plan.external_ref(k)) for k in plan.constants}
        sealed_flats = {plan.flat(v) for s in sealed for v in plan.slots[s].outputs if v is not None}
        resident: list[tuple[int, ...]] = []
        for slot in plan.slots:
            reads = [plan.flat(r) for r in slot.inputs if r is not None]
            mine = [f for f in reads if f in constant_flats or f in sealed_flats]
            if slot.index in sealed:
                mine += [plan.flat(v) for v in slot.outputs if v is not None]
            resident.append(tuple(dict.fromkeys(mine)))
        return cls(sizes, sealed, resident)

    def slot_weight(self, s: int) -> int:
        return sum(self.sizes.get(f, 0) for f in self.resident[s])


def _activation_crossings(plan: Plan, sealed: frozenset[int]) -> tuple[list[int], list[list[int]]]:
    """Per boundary b (between slot b and b+1): modelled bytes of per-step values alive across it, and which."""
    n = len(plan.slots)
    last: dict[int, int] = {}
    producer: dict[int, int] = {}
    for slot in plan.slots:
        for v in slot.outputs:
            if v is not None:
                producer[v] = slot.index
        for r in slot.inputs:
            if r is not None and r >= 0:
                last[r] = max(last.get(r, -1), slot.index)
    diff = [0] * (n + 1)
    members: list[list[int]] = [[] for _ in range(max(n - 1, 0))]
    for v, end in last.items():
        start = producer.get(v)
        if start is None or start in sealed or end <= start:
            continue
        size = nbytes_of(plan.values[v].dtype, plan.values[v].shape)
        diff[start] += size
        diff[end] -= size
        for b in range(start, end):
            members[b].append(v)
    crossing, running = [], 0
    for b in range(max(n - 1, 0)):
        running += diff[b]
        crossing.append(running)
    return crossing, members


# -- budgets ----------------------------------------------------------------------------
def budgets(topology: Topology) -> tuple[int, ...]:
    """Per device: its free memory, capped by DSP_MAX_DEVICE_MEMORY (0 = no cap), minus the reserve.

    The reserve is kept within the cap: the allocator is capped too (CuPy's pool, on CUDA),
    and activations, KV buffers and workspaces need room beside the weights.
    """
    reserve = float(config.get("device_memory_reserve"))
    cap = int(config.get("max_device_memory"))
    return tuple(int((min(d.memory, cap) if cap else d.memory) * (1.0 - reserve)) for d in topology.devices)


def _budget_note(topology: Topology, device: int) -> str:
    cap = int(config.get("max_device_memory"))
    reserve = float(config.get("device_memory_reserve"))
    free = topology[device].memory
    limit = f"{_mb(free)} free"
    if cap:
        limit = f"the lesser of {limit} and DSP_MAX_DEVICE_MEMORY={config.format_size(cap)}"
    return f"{limit}, minus the {reserve:.0%} reserve (DSP_DEVICE_MEMORY_RESERVE)"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _over_budget(
    topology: Topology, device: int, need: int, budget: int, what: str, spread: bool = True
) -> PlacementError:
    knob = "raise DSP_MAX_DEVICE_MEMORY" if config.get("max_device_memory") else "lower DSP_DEVICE_MEMORY_RESERVE"
    remedy = f"{knob}, add devices" + (
        ", or spread the plan (placement='memory_fit' or 'pipeline_parallel')" if spread else ""
    )
    return PlacementError(
        f"device {device} ({topology[device].platform}) cannot take {what}: it needs {need} bytes "
        f"({_mb(need)}) and its budget is {budget} bytes ({_mb(budget)}: {_budget_note(topology, device)}); {remedy}"
    )


# -- the strategies ---------------------------------------------------------------------
def parse(placement: Any) -> tuple[Strategy, Mapping[str, int] | None]:
    """A strategy from ``"memory_fit"`` (any case), a Strategy, or a {pattern: device} map (CUSTOM)."""
    if placement is None:
        return Strategy(config.get("placement")), None
    if isinstance(placement, Strategy):
        if placement is Strategy.CUSTOM:
            raise InputError("placement CUSTOM is given as a map {name_pattern: device}, not by name")
        return placement, None
    if isinstance(placement, Mapping):
        for pattern, device in placement.items():
            if not isinstance(pattern, str) or not isinstance(device, int) or isinstance(device, bool):
                raise InputError(
                    f"placement map entries are name_pattern (str) -> device (int), got {pattern!r}: {device!r}"
                )
        return Strategy.CUSTOM, dict(placement)
    if isinstance(placement, str):
        try:
            strategy = Strategy(placement.strip().lower())
        except ValueError:
            pass
        else:
            if strategy is not Strategy.CUSTOM:
                return strategy, None
    names = ", ".join(repr(s.value) for s in Strategy if s is not Strategy.CUSTOM)
    raise InputError(f"unknown placement {placement!r}: expected one of {names}, or a map {{name_pattern: device}}")


def place(
    plan: Plan, placement: Any = None, topology: Topology | None = None, split_siblings: bool | None = None
) -> Placement:
    """Run the placement pass over ``plan`` on ``topology`` (default: the current one).

    ``split_siblings`` (None: DSP_SPLIT_SIBLINGS, default off) then spreads sibling products
    (``split_sibling_products``).
    """
    from dsp_core.devices.topology import current_topology

    topo = topology if topology is not None else current_topology()
    strategy, mapping = parse(placement)
    info = _Bytes.of(plan)
    limits = budgets(topo)
    if strategy is Strategy.SINGLE_DEVICE:
        devices = [0] * len(plan.slots)
    elif strategy is Strategy.MEMORY_FIT:
        devices = _memory_fit(plan, topo, info, limits)
    elif strategy is Strategy.PIPELINE_PARALLEL:
        devices = _pipeline(plan, topo, info)
    else:
        assert mapping is not None
        devices = _custom(plan, topo, mapping)
    if config.get("split_siblings", split_siblings) and len(topo) > 1:
        devices = split_sibling_products(plan, devices, len(topo), info.sealed)
    result = _finish(plan, topo, strategy, devices, info, limits)
    for d in range(len(topo)):
        if result.weights[d] > limits[d]:
            spread = strategy in (Strategy.SINGLE_DEVICE, Strategy.CUSTOM)
            what = f"its share of the weights ({strategy.value})"
            raise _over_budget(topo, d, result.weights[d], limits[d], what, spread)
    return result


PRODUCTS = frozenset({"MatMul", "Gemm"})


def sibling_products(plan: Plan, sealed: frozenset[int] = frozenset()) -> list[list[int]]:
    """Groups of two or more products (MatMul, Gemm) that read one computed input, each with a weight.

    The seed's ``splitParallelGroups``: Q, K and V projections of one normalised input, the
    gate and up projections of a gated MLP. Their weights are constants or sealed values.
    Products the compiler merged (``dsp::MergedMatMul``, DSP_MERGE_PRODUCTS) are one slot
    and never a group here.
    """
    resident = set(plan.flat(plan.external_ref(k)) for k in plan.constants)
    resident |= {plan.flat(v) for s in sealed for v in plan.slots[s].outputs if v is not None}
    groups: dict[int, list[int]] = {}
    for slot in plan.slots:
        if slot.op not in PRODUCTS or slot.domain not in ("", "ai.onnx") or slot.index in sealed:
            continue
        if len(slot.inputs) < 2 or slot.inputs[0] is None or slot.inputs[1] is None:
            continue
        if plan.flat(slot.inputs[1]) in resident and plan.flat(slot.inputs[0]) not in resident:
            groups.setdefault(slot.inputs[0], []).append(slot.index)
    return [g for g in groups.values() if len(g) > 1]


def split_sibling_products(plan: Plan, devices: list[int], n: int, sealed: frozenset[int] = frozenset()) -> list[int]:
    """``devices`` with each group of sibling products spread round-robin from its first product's device.

    Only the products move (with their weights, which live where their reader runs): their
    input is copied to the other devices and each result back to its readers, and on devices
    that run asynchronously (CUDA) the products of one group overlap. Off unless asked for.
    """
    out = list(devices)
    for group in sibling_products(plan, sealed):
        base = devices[group[0]]
        for i, s in enumerate(group):
            out[s] = (base + i) % n
    return out


def _memory_fit(plan: Plan, topo: Topology, info: _Bytes, limits: tuple[int, ...]) -> list[int]:
    devices: list[int] = []
    current, used = 0, 0
    here: set[int] = set()
    for s in range(len(plan.slots)):
        new = [f for f in info.resident[s] if f not in here]
        need = sum(info.sizes.get(f, 0) for f in new)
        if used + need > limits[current] and used > 0:
            current += 1
            if current >= len(topo):
                total = sum(info.sizes.get(f, 0) for f in {f for r in info.resident for f in r})
                raise PlacementError(
                    f"memory_fit: the plan's weights ({total} bytes, {_mb(total)}) do not fit on the "
                    f"{len(topo)} device(s): slot {s} ({plan.slots[s].op} {plan.slots[s].name!r}) needs "
                    f"{need} more bytes and device {len(topo) - 1} has {limits[-1] - used + 0} of its budget "
                    f"{limits[-1]} left ({_budget_note(topo, len(topo) - 1)})"
                )
            used, here = 0, set()
            new = list(info.resident[s])
            need = sum(info.sizes.get(f, 0) for f in new)
        if need > limits[current]:
            what = f"slot {s} ({plan.slots[s].name!r}) alone (a slot's weights live on one device)"
            raise _over_budget(topo, current, need, limits[current], what, spread=False)
        here.update(new)
        used += need
        devices.append(current)
    return devices


def _pipeline(plan: Plan, topo: Topology, info: _Bytes) -> list[int]:
    n, stages = len(plan.slots), len(topo)
    if n == 0:
        return []
    stages = min(stages, n)
    crossing, _ = _activation_crossings(plan, info.sealed)
    cumulative, total = [], 0
    for s in range(n):
        total += info.slot_weight(s)
        cumulative.append(total)
    cuts: list[int] = []
    for k in range(1, stages):
        lo = cuts[-1] + 1 if cuts else 0
        hi = n - 1 - (stages - k)  # leave at least one slot for each later stage
        if lo > hi:
            break
        if total > 0:
            share = total / stages
            target = share * k
            window = [b for b in range(lo, hi + 1) if abs(cumulative[b] - target) <= BALANCE * share]
        else:
            target, share = float(n * k / stages), 1.0
            window = [b for b in range(lo, hi + 1) if abs(b + 1 - target) <= BALANCE * n / stages]
        if not window:  # the weights jump over the window (one huge slot): the boundary nearest the target
            window = [min(range(lo, hi + 1), key=lambda b: abs(cumulative[b] - target))]
        position = (lambda b: cumulative[b]) if total > 0 else (lambda b: b + 1)
        cuts.append(min(window, key=lambda b: (crossing[b], abs(position(b) - target), b)))
    devices, stage = [], 0
    for s in range(n):
        devices.append(stage)
        if stage < len(cuts) and s == cuts[stage]:
            stage += 1
    return devices


def _custom(plan: Plan, topo: Topology, mapping: Mapping[str, int]) -> list[int]:
    for pattern, device in mapping.items():
        if not 0 <= device < len(topo):
            raise PlacementError(
                f"placement map: {pattern!r} -> device {device}, but the topology has devices 0..{len(topo) - 1}"
            )
    devices: list[int] = []
    matched = dict.fromkeys(mapping, False)
    for slot in plan.slots:
        names = [slot.name, *(plan.values[v].name for v in slot.outputs if v is not None)]
        chosen = None
        for pattern, device in mapping.items():
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                chosen, matched[pattern] = device, True
                break
        devices.append(chosen if chosen is not None else (devices[-1] if devices else 0))
    # One model's plans differ (a decoder's prefill, decode and block plans): a pattern may
    # miss one of them, but a map none of whose patterns matches is a mistake.
    if mapping and not any(matched.values()):
        shown = ", ".join(repr(p) for p in mapping)
        raise PlacementError(f"placement map: no pattern ({shown}) matches a node or value name of the plan")
    return devices


def _finish(
    plan: Plan, topo: Topology, strategy: Strategy, devices: list[int], info: _Bytes, limits: tuple[int, ...]
) -> Placement:
    """Homes of externals, resident bytes per device, replicas and cuts of a slot -> device map."""
    first_reader: dict[int, int] = {}
    for slot in plan.slots:
        if slot.traits & Trait.SHAPE_ONLY_OUTPUT:
            continue  # reads a shape, not the data: no reason to live there
        for r in slot.inputs:
            if r is not None and r < 0:
                first_reader.setdefault(-r - 1, devices[slot.index])
    homes = [first_reader.get(k, 0) for k in range(len(plan.externals))]
    home_of: dict[int, int] = {}
    readers_of: dict[int, set[int]] = {}
    for s, flats in enumerate(info.resident):
        for f in flats:
            home_of.setdefault(f, devices[s])
            readers_of.setdefault(f, set()).add(devices[s])
    weights = [0] * len(topo)
    replicas: dict[int, tuple[int, ...]] = {}
    for f, home in home_of.items():
        size = info.sizes.get(f, 0)
        for d in readers_of[f] | {home}:
            weights[d] += size
        others = tuple(sorted(readers_of[f] - {home}))
        if others:
            replicas[f] = others
    _, members = _activation_crossings(plan, info.sealed)
    cuts = []
    for b in range(len(devices) - 1):
        if devices[b] != devices[b + 1]:
            values = tuple(members[b])
            size = sum(nbytes_of(plan.values[v].dtype, plan.values[v].shape) for v in values)
            cuts.append(Cut(b, devices[b], devices[b + 1], values, size))
    return Placement(
        strategy, topo, tuple(devices), tuple(homes), limits, tuple(weights), replicas, tuple(cuts), info.sealed
    )
