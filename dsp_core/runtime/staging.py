"""Staging: feeds are copied into stable buffers so a replay reads fixed addresses.

Placeholders are copied every step into buffers allocated once per live plan (after
freezing); variables are read in place (their address is part of the identity keys);
constants are snapshotted at freeze and a replaced weight is rejected.

``DSP_STAGING_FAULT=<fault>`` (allocation, copy, stream_sync) makes the staging path fail
on purpose, for tests: each raises a StagingError before any replay runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from dsp_core.errors import DSPError
from dsp_core.plan.plan import constant_digest

FAULTS = ("allocation", "copy", "stream_sync", "stale_buffer")


class StagingError(DSPError):
    """Feeds could not be staged into the plan's stable buffers; nothing was replayed."""


def injected_fault() -> str | None:
    """The fault DSP_STAGING_FAULT asks for, or None; an unknown name is a StagingError."""
    fault = os.environ.get("DSP_STAGING_FAULT")
    if not fault:
        return None
    if fault not in FAULTS:
        raise StagingError(f"DSP_STAGING_FAULT={fault!r} is not a known fault; known: {', '.join(FAULTS)}")
    return fault


class Staging:
    """Stable buffers for a live plan's placeholders, filled by copy before each step."""

    def __init__(self) -> None:
        self.buffers: dict[int, Any] = {}  # flat index -> stable buffer
        self.copies = 0
        self.allocations = 0
        # flat index -> the backend that allocates and fills its buffer (a device backend
        # whose units are the only readers of that placeholder: see ``placement``)
        self.placement: dict[int, Any] = {}
        # A plan placed over several devices: flat index -> the device context its buffer is
        # made and filled in (the device of its first reader: a feed goes straight there).
        self.devices: dict[int, Callable[[], AbstractContextManager[Any]]] = {}
        # flat index -> how its buffer is filled: the placing backend's ``stage_into`` for a
        # buffer that backend made, absent for a host buffer (filled with ``buf[...] = value``)
        self.fills: dict[int, Callable[[Any, Any], None]] = {}

    def stage(self, flat: int, value: Any) -> Any:
        """Copy ``value`` into the stable buffer for ``flat`` (allocated on first use)."""
        device = self.devices.get(flat)
        if device is not None:
            with device():
                return self._stage(flat, value)
        return self._stage(flat, value)

    def _stage(self, flat: int, value: Any) -> Any:
        fault = injected_fault()
        buf = self.buffers.get(flat)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            if fault == "allocation":
                raise StagingError(f"staging buffer allocation failed for input at slot {flat} (injected fault)")
            placer = self.placement.get(flat)
            buf = placer.stage_buffer(value) if placer is not None else None
            if placer is not None and buf is not None:
                self.fills[flat] = placer.stage_into
            else:
                buf = _empty_like(value)
                self.fills.pop(flat, None)
            self.buffers[flat] = buf
            self.allocations += 1
        if fault == "copy":
            raise StagingError(f"staging copy failed for input at slot {flat} (injected fault)")
        if value is not buf:  # a binding's input is its buffer, written in place (CompiledModel.bind)
            fill = self.fills.get(flat)
            if fill is not None:
                fill(buf, value)
            else:
                buf[...] = value
            self.copies += 1
        if fault == "stream_sync":
            raise StagingError("stream synchronisation after staging failed (injected fault)")
        return buf

    def invalidate(self) -> None:
        """Forget every buffer (they are reallocated on the next step)."""
        self.buffers.clear()
        self.fills.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        return sum(int(getattr(b, "nbytes", 0)) for b in self.buffers.values())


def placement(units: Any, flats: frozenset[int]) -> dict[int, Any]:
    """Placeholders whose readers all belong to one backend that stages onto its device.

    ``units`` are a frozen plan's units (dsp_core.runtime.units.Unit). A backend opts in by
    overriding ``Backend.stage_buffer``; any placeholder read by a unit of another backend
    stays on the host.
    """
    from dsp_core.backends.base import Backend

    readers: dict[int, set[Any]] = {}
    for unit in units:
        for i in unit.inputs:
            if i in flats:
                readers.setdefault(i, set()).add(unit.backend)
    return {
        flat: next(iter(owners))
        for flat, owners in readers.items()
        if len(owners) == 1 and type(next(iter(owners))).stage_buffer is not Backend.stage_buffer
    }


def _empty_like(value: Any) -> Any:
    xp = _namespace(value)
    return xp.empty(value.shape, dtype=value.dtype)


def _namespace(value: Any) -> Any:
    """numpy for host arrays, the array's own module (cupy) for device arrays."""
    if isinstance(value, np.ndarray):
        return np
    module = type(value).__module__.split(".")[0]
    return __import__(module)


class ConstantSnapshot:
    """The identity and content digest of every constant at freeze time.

    ``known``: digests the plan already holds (``Plan.constant_digests``: verified when the
    plan was loaded from the disk cache, or computed when it was stored), taken as they
    are rather than hashing hundreds of megabytes of weights again at every freeze.
    """

    def __init__(self, constants: dict[int, Any], known: dict[int, bytes] | None = None) -> None:
        known = known or {}
        self.ids = {k: id(a) for k, a in constants.items()}
        self.digests = {k: known.get(k) or _digest(a) for k, a in constants.items()}

    def check_identity(self, constants: dict[int, Any], names: dict[int, str]) -> None:
        """StagingError naming the constant if an array was replaced since the snapshot."""
        for k, ident in self.ids.items():
            if id(constants.get(k)) != ident:
                raise StagingError(
                    f"constant {names.get(k, k)!r} was replaced after the plan froze; weights are snapshotted "
                    "at freeze: compile the model again to use new weights"
                )

    def check_content(self, constants: dict[int, Any], names: dict[int, str]) -> None:
        """StagingError naming the constant if its bytes changed since the snapshot."""
        self.check_identity(constants, names)
        for k, digest in self.digests.items():
            if _digest(constants[k]) != digest:
                raise StagingError(
                    f"constant {names.get(k, k)!r} was modified in place after the plan froze; "
                    "compile the model again to use new weights"
                )


def _digest(array: Any) -> bytes:
    """The plan's constant digest (``plan.constant_digest``), so a known one compares equal."""
    return constant_digest(np.asarray(array))
