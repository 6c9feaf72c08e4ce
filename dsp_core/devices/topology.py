"""Devices and how they connect: memory, peer access, modelled bandwidths.

A Topology is the set of devices a plan may be placed on. It comes from one of:
- ``stub_topology([...])``: fake devices for tests on any machine (the CPU reference
  backend runs each one's segments; copies between them are real numpy copies, timed by
  the model below);
- ``cuda_topology()``: the CUDA devices CuPy sees (free memory, peer access, compute
  capability);
- ``host_topology()``: one device, the host (what a machine without either has).

``current_topology()`` answers with the innermost topology in use (``stub_topology`` or
``use_topology``, e.g. the CUDA topology with peer access switched off), else CUDA when
CuPy sees a device, else the host. Bandwidths model copy time: a copy of ``n`` bytes between devices
with peer access takes ``n / peer_bandwidth``, through the host ``n / bandwidth``, from
or to the host ``n / host_bandwidth`` (defaults 300, 12 and 16 GB/s).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dsp_core.errors import InputError

GB = 1e9
PEER_BANDWIDTH = 300 * GB
NON_PEER_BANDWIDTH = 12 * GB
HOST_BANDWIDTH = 16 * GB
HOST = -1  # the device index of the host (feeds arrive from it, outputs return to it)


@dataclass(frozen=True)
class Device:
    """One device: index, platform, compute capability, memory and who it reaches directly."""

    index: int
    platform: str  # "stub", "cuda", "cpu"
    capability: str  # "9.0" for an H200; "" where it does not apply
    memory: int  # bytes placement may use on it (free memory, before DSP_MAX_DEVICE_MEMORY)
    peers: frozenset[int] = frozenset()
    peer_bandwidth: float = PEER_BANDWIDTH  # bytes/s to a peer
    bandwidth: float = NON_PEER_BANDWIDTH  # bytes/s to a device that is not a peer (through the host)
    host_bandwidth: float = HOST_BANDWIDTH  # bytes/s from and to the host

    @property
    def key(self) -> tuple[str, str]:
        """(platform, capability): kernels compiled for one key never run on another."""
        return (self.platform, self.capability)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "index": self.index,
            "platform": self.platform,
            "capability": self.capability,
            "memory": self.memory,
            "peers": sorted(self.peers),
            "bandwidth_gbs": {
                "peer": self.peer_bandwidth / GB,
                "non_peer": self.bandwidth / GB,
                "host": self.host_bandwidth / GB,
            },
        }


@dataclass(frozen=True)
class Topology:
    """The devices a plan may be placed on."""

    devices: tuple[Device, ...]
    kind: str  # "stub", "cuda" or "host"

    def __len__(self) -> int:
        return len(self.devices)

    def __getitem__(self, index: int) -> Device:
        return self.devices[index]

    def peer(self, src: int, dst: int) -> bool:
        """True when ``src`` and ``dst`` copy directly (either side granting access is enough)."""
        if src == dst:
            return True
        if src == HOST or dst == HOST:
            return False
        return dst in self.devices[src].peers or src in self.devices[dst].peers

    def bandwidth(self, src: int, dst: int) -> float:
        """Modelled bytes/s of a copy from ``src`` to ``dst`` (HOST for the host)."""
        if src == HOST or dst == HOST:
            return self.devices[dst if src == HOST else src].host_bandwidth
        if self.peer(src, dst):
            return min(self.devices[src].peer_bandwidth, self.devices[dst].peer_bandwidth)
        return min(self.devices[src].bandwidth, self.devices[dst].bandwidth)

    def modelled_seconds(self, src: int, dst: int, nbytes: int) -> float:
        """What the model says a copy of ``nbytes`` from ``src`` to ``dst`` costs."""
        return 0.0 if src == dst else nbytes / self.bandwidth(src, dst)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"kind": self.kind, "devices": [d.as_dict() for d in self.devices]}


_stack: list[Topology] = []
_stack_lock = threading.Lock()


def _stub(specs: Sequence[Mapping[str, Any]]) -> Topology:
    """A stub topology from dicts: ``memory`` (bytes), optional ``peers``, ``bandwidth`` and friends."""
    if not specs:
        raise InputError("stub_topology needs at least one device, e.g. [{'memory': 2**30}]")
    devices = []
    known = {"memory", "peers", "bandwidth", "peer_bandwidth", "host_bandwidth", "capability"}
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            raise InputError(f"stub device {i}: a dict like {{'memory': 2**30}}, not {type(spec).__name__}")
        unknown = sorted(set(spec) - known)
        if unknown:
            raise InputError(f"stub device {i}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        memory = spec.get("memory")
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise InputError(f"stub device {i}: 'memory' must be a positive number of bytes, got {memory!r}")
        peers = frozenset(int(p) for p in spec.get("peers", ()))
        bad = sorted(p for p in peers if not 0 <= p < len(specs) or p == i)
        if bad:
            raise InputError(
                f"stub device {i}: peer {bad[0]} is not another device of the topology (0..{len(specs) - 1})"
            )
        devices.append(
            Device(
                i,
                "stub",
                str(spec.get("capability", "")),
                memory,
                peers,
                float(spec.get("peer_bandwidth", PEER_BANDWIDTH)),
                float(spec.get("bandwidth", NON_PEER_BANDWIDTH)),
                float(spec.get("host_bandwidth", HOST_BANDWIDTH)),
            )
        )
    # Peer access is symmetric in the model: a peer named on either side links both.
    linked = [frozenset(d.peers | {e.index for e in devices if d.index in e.peers}) for d in devices]
    return Topology(tuple(dataclasses.replace(d, peers=p) for d, p in zip(devices, linked)), "stub")


@contextmanager
def use_topology(topology: Topology) -> Iterator[Topology]:
    """Make ``topology`` the current one for the ``with`` block (always restored, nests)."""
    with _stack_lock:
        _stack.append(topology)
    try:
        yield topology
    finally:
        with _stack_lock:
            _stack.remove(topology)


@contextmanager
def stub_topology(specs: Sequence[Mapping[str, Any]]) -> Iterator[Topology]:
    """Declare fake devices for the ``with`` block (always restored, nests)."""
    with use_topology(_stub(specs)) as topology:
        yield topology


def host_topology() -> Topology:
    """One device: the host."""
    from dsp_core.cache.memory import available_host_bytes

    return Topology((Device(0, "cpu", "", int(available_host_bytes())),), "host")


def cuda_topology() -> Topology | None:
    """The CUDA devices CuPy sees (free memory, peers, capability), or None without CuPy or a device."""
    try:
        import cupy
    except Exception:  # noqa: BLE001  (no CuPy, or a broken CUDA install: no CUDA topology)
        return None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001
        return None
    if count < 1:
        return None
    devices = []
    for i in range(count):
        with cupy.cuda.Device(i) as dev:
            free, _total = cupy.cuda.runtime.memGetInfo()
            cc = str(dev.compute_capability)  # "90" for 9.0
        peers = frozenset(j for j in range(count) if j != i and cupy.cuda.runtime.deviceCanAccessPeer(i, j))
        devices.append(Device(i, "cuda", f"{cc[:-1]}.{cc[-1]}", int(free), peers))
    return Topology(tuple(devices), "cuda")


def current_topology() -> Topology:
    """The innermost topology in use (``stub_topology``, ``use_topology``), else the CUDA devices, else the host."""
    with _stack_lock:
        if _stack:
            return _stack[-1]
    return cuda_topology() or host_topology()
