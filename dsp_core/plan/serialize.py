"""DSP1: the binary format of a Plan, for the disk cache (the spec is docs/dsp1.md).

A hand-written, versioned, little-endian layout: a 32-byte header, then one plan record
made of tagged sections (sub-plans of control-flow regions nest as plan records). Never
pickle: every length, count, index, tag and enum read from the file is checked before
use, and anything malformed raises PlanFormatError naming the field and its byte offset.

Constants larger than ``inline_limit`` are stored by reference (their external's name,
dtype and shape, plus a digest of their bytes) and fetched back with ``resolve``.

After decoding, two digests prove the plan whole: ``content_hash`` (recomputed with the
compiler's function) covers what the plan computes, and the meta digest covers the rest
(names, static dtypes and shapes, traits, liveness, attribute encodings). So a corrupt
file yields an error, never a different plan, even when the payload checksum is skipped.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn

import numpy as np

from dsp_core.errors import DSPError, DTypeError, PlanFormatError, UnsupportedOpError
from dsp_core.ir import dtypes
from dsp_core.ops.registry import Trait, has_op, lookup
from dsp_core.plan.compiler import content_hash
from dsp_core.plan.plan import Dim, External, ExternalClass, Plan, Region, Slot, ValueInfo, constant_digest

log = logging.getLogger("dsp.plan")

MAGIC = b"DSP1"
VERSION = 1

Resolver = Callable[[str], "np.ndarray | None"]
# by_digest(digest hex, byte length) -> the constant's C-order bytes, already verified, or None
WeightReader = Callable[[str, int], "bytes | bytearray | memoryview | None"]

_HEADER = struct.Struct("<4sHHQ16s")  # magic, version, flags, payload length, blake2b-16(payload)
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_DIGEST = 16

_NONE_REF = 0x7FFFFFFF  # the wiring reference None (a missing optional input or unnamed output)
_DTYPE_NONE = 0  # dtype code: unknown dtype
_DTYPE_NAMED = 255  # dtype code: a name DSP does not compute with ("unsupported:string"), stored as text
_MAX_PLAN_DEPTH = 32  # sub-plan nesting
_MAX_ATTR_DEPTH = 8  # lists nested in attribute values
_MAX_RANK = 64  # numpy's limit
_MAX_DIM = 1 << 48


class Section(enum.IntEnum):
    """Section tags of a plan record, in the order they must appear."""

    HEAD = 1
    OPS = 2
    EXTERNALS = 3
    VALUES = 4
    SLOTS = 5
    OUTPUTS = 6
    RELEASE = 7
    CONSTANTS = 8
    REGIONS = 9
    CAPTURE_GAPS = 10  # optional, last: written only when the plan learned gaps (Plan.capture_gaps)


class AttrTag(enum.IntEnum):
    """Tags of attribute values."""

    NONE = 0
    INT = 1  # i64
    FLOAT = 2  # f64, bit-exact
    STR = 3
    BOOL = 4
    ARRAY = 5
    LIST = 6
    TUPLE = 7
    SCALAR = 8  # a numpy scalar (np.float32(1.5), ...)


class _Dim(enum.IntEnum):
    NONE = 0
    INT = 1
    STR = 2


class _Store(enum.IntEnum):
    INLINE = 0
    REF = 1


_CLASS_CODES: dict[ExternalClass, int] = {
    ExternalClass.CONSTANT: 0,
    ExternalClass.VARIABLE: 1,
    ExternalClass.PLACEHOLDER: 2,
    ExternalClass.OUTER: 3,
}
_CLASS_BY_CODE = {code: cls for cls, code in _CLASS_CODES.items()}


def fnv1a64(data: bytes) -> int:
    """The 64-bit FNV-1a hash of ``data`` (the disk cache's entry key)."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _blake16(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _cannot(what: str, detail: str) -> NoReturn:
    raise PlanFormatError(f"cannot serialize plan: {what}: {detail}")


# =====================================================================================
# Writing


class _Writer:
    """A growing little-endian byte buffer."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def pack(self, fmt: struct.Struct, value: Any, what: str) -> None:
        try:
            self.buf += fmt.pack(value)
        except struct.error as exc:
            _cannot(what, f"{value!r} does not fit ({exc})")

    def u8(self, v: int, what: str = "byte") -> None:
        self.pack(_U8, v, what)

    def u32(self, v: int, what: str = "count") -> None:
        self.pack(_U32, v, what)

    def i32(self, v: int, what: str = "reference") -> None:
        self.pack(_I32, v, what)

    def u64(self, v: int, what: str = "length") -> None:
        self.pack(_U64, v, what)

    def i64(self, v: int, what: str = "integer") -> None:
        self.pack(_I64, v, what)

    def raw(self, data: bytes | bytearray | memoryview) -> None:
        self.buf += data

    def text(self, s: str, what: str = "string") -> None:
        try:
            data = s.encode("utf-8")
        except UnicodeEncodeError as exc:
            _cannot(what, f"{s!r} is not encodable as UTF-8 ({exc})")
        self.u32(len(data), what)
        self.buf += data

    def ref(self, r: int | None) -> None:
        if r is not None and r == _NONE_REF:
            _cannot("wiring reference", f"{r} is reserved for None")
        self.i32(_NONE_REF if r is None else r)

    def section(self, tag: Section, body: _Writer) -> None:
        self.u8(tag)
        self.u64(len(body.buf))
        self.buf += body.buf


def _write_dtype(w: _Writer, dtype: str | None) -> None:
    if dtype is None:
        w.u8(_DTYPE_NONE)
        return
    code = _dtype_code(dtype)
    if code is None:
        w.u8(_DTYPE_NAMED)
        w.text(dtype, "dtype name")
    else:
        w.u8(code)


@functools.lru_cache(maxsize=1)
def _dtype_codes() -> dict[str, int]:
    """DSP dtype name -> its code (the ONNX TensorProto enum), for every dtype this build knows."""
    codes: dict[str, int] = {}
    for code in range(_DTYPE_NONE + 1, _DTYPE_NAMED):
        try:
            codes[dtypes.from_onnx(code)] = code
        except DTypeError:
            continue
    return codes


def _dtype_code(dtype: str) -> int | None:
    """The code of a DSP dtype name, or None for a name DSP does not compute with (no parsing)."""
    return _dtype_codes().get(dtype)


def _write_shape(w: _Writer, shape: Sequence[Dim] | None) -> None:
    if shape is None:
        w.u8(0)
        return
    w.u8(1)
    w.u32(len(shape), "rank")
    for d in shape:
        if d is None:
            w.u8(_Dim.NONE)
        elif type(d) is int:
            w.u8(_Dim.INT)
            w.i64(d, "dimension")
        elif type(d) is str:
            w.u8(_Dim.STR)
            w.text(d, "dimension name")
        else:
            _cannot("shape", f"dimension {d!r} of type {type(d).__name__} (want int, str or None)")


def _array_dtype_code(dtype: np.dtype[Any], what: str) -> int:
    try:
        code = _dtype_code(dtypes.normalize(dtype))
    except DTypeError as exc:
        _cannot(what, str(exc))
    if code is None:
        _cannot(what, f"dtype {dtype} has no DSP1 code")
    return code


def _write_array(w: _Writer, arr: np.ndarray, what: str) -> None:
    w.u8(_array_dtype_code(arr.dtype, what))
    w.u32(arr.ndim, "rank")
    for d in arr.shape:
        w.u64(d, "dimension")
    data = arr.tobytes()  # C order, whatever the array's layout
    w.u64(len(data))
    w.raw(data)


def _write_attr(w: _Writer, value: Any, what: str, depth: int = 0) -> None:
    kind = type(value)
    if value is None:
        w.u8(AttrTag.NONE)
    elif kind is bool:
        w.u8(AttrTag.BOOL)
        w.u8(int(value))
    elif kind is int:
        w.u8(AttrTag.INT)
        w.i64(value, what)
    elif kind is float:
        w.u8(AttrTag.FLOAT)
        w.pack(_F64, value, what)
    elif kind is str:
        w.u8(AttrTag.STR)
        w.text(value, what)
    elif kind is np.ndarray:
        w.u8(AttrTag.ARRAY)
        _write_array(w, value, what)
    elif isinstance(value, np.generic):
        w.u8(AttrTag.SCALAR)
        w.u8(_array_dtype_code(value.dtype, what))
        w.raw(value.tobytes())
    elif kind is list or kind is tuple:
        _write_sequence(w, value, what, depth)
    else:
        _cannot(
            what,
            f"attribute value of type {kind.__name__} (DSP1 stores None, bool, int, float, "
            "str, numpy arrays and scalars, and lists or tuples of these)",
        )


def _write_sequence(w: _Writer, value: list[Any] | tuple[Any, ...], what: str, depth: int) -> None:
    if depth >= _MAX_ATTR_DEPTH:
        _cannot(what, f"lists nested deeper than {_MAX_ATTR_DEPTH}")
    w.u8(AttrTag.LIST if type(value) is list else AttrTag.TUPLE)
    w.u32(len(value))
    for item in value:
        _write_attr(w, item, what, depth + 1)


def _write_attrs(w: _Writer, attrs: Mapping[str, Any], where: str) -> None:
    w.u32(len(attrs))
    for key, value in attrs.items():
        w.text(key, "attribute name")
        _write_attr(w, value, f"{where} attribute {key!r}")


def _write_value_info(w: _Writer, name: str, dtype: str | None, shape: Sequence[Dim] | None) -> None:
    w.text(name, "name")
    _write_dtype(w, dtype)
    _write_shape(w, shape)


def _meta_digest(plan: Plan) -> bytes:
    """Digest of what content_hash leaves out: names, static infos, traits, liveness, attrs."""
    w = _Writer()
    w.text(plan.graph_name)
    w.u32(len(plan.output_names))
    for name in plan.output_names:
        w.text(name)
    w.u32(len(plan.values))
    for v in plan.values:
        _write_value_info(w, v.name, v.dtype, v.shape)
    w.u32(len(plan.slots))
    for slot in plan.slots:
        w.text(slot.name)
        w.u64(slot.traits.value)
        _write_attrs(w, slot.attrs, f"slot {slot.index}")
    w.u32(len(plan.release))
    for rel in plan.release:
        _write_u32s(w, rel)
    return _blake16(w.buf)


def _write_u32s(w: _Writer, items: Sequence[int]) -> None:
    w.u32(len(items))
    for v in items:
        w.u32(v, "value id")


def _check_dumpable(plan: Plan) -> None:
    if len(plan.outputs) != len(plan.output_names):
        _cannot("outputs", f"{len(plan.outputs)} refs but {len(plan.output_names)} names")
    if len(plan.release) != len(plan.slots):
        _cannot("release", f"{len(plan.release)} entries for {len(plan.slots)} slots")
    if content_hash(plan) != plan.content_hash:
        _cannot("content_hash", f"{plan.content_hash!r} is stale (the plan was changed after compiling)")


def _op_table(slots: Sequence[Slot]) -> dict[tuple[str, str], int]:
    table: dict[tuple[str, str], int] = {}
    for slot in slots:
        table.setdefault((slot.domain, slot.op), len(table))
    return table


def _head_section(plan: Plan) -> _Writer:
    w = _Writer()
    w.text(plan.graph_name, "graph name")
    w.text(plan.content_hash, "content hash")
    w.raw(_meta_digest(plan))
    return w


def _ops_section(ops: dict[tuple[str, str], int]) -> _Writer:
    w = _Writer()
    w.u32(len(ops))
    for domain, op in ops:
        w.text(domain, "domain")
        w.text(op, "op")
    return w


def _externals_section(plan: Plan) -> _Writer:
    w = _Writer()
    w.u32(len(plan.externals))
    for ext in plan.externals:
        w.text(ext.name, "external name")
        w.u8(_CLASS_CODES[ext.cls])
        _write_dtype(w, ext.dtype)
        _write_shape(w, ext.shape)
    return w


def _values_section(plan: Plan) -> _Writer:
    w = _Writer()
    w.u32(len(plan.values))
    for v in plan.values:
        _write_value_info(w, v.name, v.dtype, v.shape)
    return w


def _slots_section(plan: Plan, ops: dict[tuple[str, str], int]) -> _Writer:
    w = _Writer()
    w.u32(len(plan.slots))
    for slot in plan.slots:
        w.text(slot.name, "slot name")
        w.u32(ops[(slot.domain, slot.op)])
        w.i64(slot.opset, "opset")
        w.u64(slot.traits.value, "traits")
        for refs in (slot.inputs, slot.outputs):
            w.u32(len(refs))
            for r in refs:
                w.ref(r)
        _write_attrs(w, slot.attrs, f"slot {slot.index} ({slot.name!r})")
    return w


def _outputs_section(plan: Plan) -> _Writer:
    w = _Writer()
    w.u32(len(plan.outputs))
    for ref, name in zip(plan.outputs, plan.output_names):
        w.ref(ref)
        w.text(name, "output name")
    return w


def _release_section(plan: Plan) -> _Writer:
    w = _Writer()
    w.u32(len(plan.release))
    for rel in plan.release:
        _write_u32s(w, rel)
    return w


def _capture_gaps_section(plan: Plan) -> _Writer:
    w = _Writer()
    w.u32(len(plan.capture_gaps), "backend count")
    for backend in sorted(plan.capture_gaps):
        gaps = plan.capture_gaps[backend]
        w.text(backend, "backend name")
        w.u32(len(gaps), "gap count")
        for slot in sorted(gaps):
            w.u32(slot, "gap slot")
            w.text(gaps[slot], "gap reason")
    return w


def _read_capture_gaps(r: _Reader, n_slots: int) -> dict[str, dict[int, str]]:
    gaps: dict[str, dict[int, str]] = {}
    for _ in range(r.count("backend count", 8)):
        at = r.pos
        backend = r.text("backend name")
        if backend in gaps:
            r.fail("backend name", f"duplicate {backend!r}", at)
        mine: dict[int, str] = {}
        for _ in range(r.count(f"gap count of {backend}", 8)):
            at = r.pos
            slot = r.u32("gap slot")
            if slot >= n_slots or slot in mine:
                r.fail("gap slot", f"slot {slot} out of range [0, {n_slots}) or repeated", at)
            mine[slot] = r.text("gap reason")
        gaps[backend] = mine
    r.done()
    return gaps


def _constants_section(plan: Plan, inline_limit: int) -> _Writer:
    w = _Writer()
    w.u32(len(plan.constants))
    for k in sorted(plan.constants):
        arr = plan.constants[k]  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        ext = plan.externals[k]
        if ext.cls is not ExternalClass.CONSTANT or ext.dtype != dtypes.normalize(arr.dtype) or ext.shape != arr.shape:
            _cannot(f"constant {ext.name!r}", f"array {arr.dtype}{list(arr.shape)} does not match its external {ext}")
        w.u32(k, "external index")
        if arr.nbytes <= inline_limit:
            w.u8(_Store.INLINE)
            w.u64(arr.nbytes)
            w.raw(arr.tobytes())
        else:
            w.u8(_Store.REF)
            w.raw(plan.digest_of(k))
    return w


def _regions_section(plan: Plan, inline_limit: int, depth: int) -> _Writer:
    w = _Writer()
    w.u32(len(plan.regions))
    for k in sorted(plan.regions):
        region = plan.regions[k]
        w.u32(k, "region slot")
        w.text(region.kind, "region kind")
        w.u32(len(region.outer))
        for name in region.outer:
            w.text(name, "outer name")
        w.u32(len(region.subplans))
        for attr, sub in region.subplans.items():
            w.text(attr, "subgraph attribute")
            record = _encode_plan(sub, inline_limit, depth + 1)
            w.u64(len(record))
            w.raw(record)
    return w


def _encode_plan(plan: Plan, inline_limit: int, depth: int) -> bytes:
    if depth > _MAX_PLAN_DEPTH:
        _cannot("regions", f"sub-plans nested deeper than {_MAX_PLAN_DEPTH}")
    _check_dumpable(plan)
    ops = _op_table(plan.slots)
    w = _Writer()
    w.section(Section.HEAD, _head_section(plan))
    w.section(Section.OPS, _ops_section(ops))
    w.section(Section.EXTERNALS, _externals_section(plan))
    w.section(Section.VALUES, _values_section(plan))
    w.section(Section.SLOTS, _slots_section(plan, ops))
    w.section(Section.OUTPUTS, _outputs_section(plan))
    w.section(Section.RELEASE, _release_section(plan))
    w.section(Section.CONSTANTS, _constants_section(plan, inline_limit))
    w.section(Section.REGIONS, _regions_section(plan, inline_limit, depth))
    if plan.capture_gaps:
        w.section(Section.CAPTURE_GAPS, _capture_gaps_section(plan))
    return bytes(w.buf)


def dumps(plan: Plan, *, inline_limit: int = 1 << 16) -> bytes:
    """Serialize ``plan`` to DSP1 bytes; constants over ``inline_limit`` bytes are stored by reference."""
    payload = _encode_plan(plan, inline_limit, 0)
    return _HEADER.pack(MAGIC, VERSION, 0, len(payload), _blake16(payload)) + payload


# =====================================================================================
# Reading


class _Reader:
    """A bounds-checked cursor over ``data[pos:end]``; offsets in messages are file offsets."""

    def __init__(self, data: bytes, pos: int, end: int, where: str) -> None:
        self.data = data
        self.pos = pos
        self.end = end
        self.where = where

    def fail(self, what: str, detail: str, at: int | None = None) -> NoReturn:
        at = self.pos if at is None else at
        raise PlanFormatError(f"invalid DSP1 plan: {what} at byte {at} ({self.where}): {detail}")

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes; returns where they start."""
        if n > self.remaining:
            self.fail(what, f"needs {n} bytes, only {self.remaining} left before byte {self.end}")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        at = self.take(fmt.size, what)
        return fmt.unpack_from(self.data, at)[0]

    def u8(self, what: str) -> int:
        return int(self.unpack(_U8, what))

    def u32(self, what: str) -> int:
        return int(self.unpack(_U32, what))

    def u64(self, what: str) -> int:
        return int(self.unpack(_U64, what))

    def i64(self, what: str) -> int:
        return int(self.unpack(_I64, what))

    def f64(self, what: str) -> float:
        return float(self.unpack(_F64, what))

    def raw(self, n: int, what: str) -> bytes:
        at = self.take(n, what)
        return self.data[at : at + n]

    def count(self, what: str, item_size: int) -> int:
        """A u32 count of items each at least ``item_size`` bytes long, checked against what is left."""
        at = self.pos
        n = self.u32(what)
        if n * item_size > self.remaining:
            self.fail(what, f"{n} items need at least {n * item_size} bytes, only {self.remaining} left", at)
        return n

    def text(self, what: str) -> str:
        n = self.u32(f"{what} length")
        at = self.take(n, what)
        try:
            return self.data[at : at + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail(what, f"invalid UTF-8 ({exc.reason} at byte {at + exc.start})", at)

    def ref(self, what: str, lo: int, hi: int) -> int | None:
        """A wiring reference: None, or an int in ``lo <= r < hi``."""
        at = self.pos
        r = int(self.unpack(_I32, what))
        if r == _NONE_REF:
            return None
        if not lo <= r < hi:
            self.fail(what, f"reference {r} out of range [{lo}, {hi})", at)
        return r

    def sub(self, n: int, what: str) -> _Reader:
        at = self.take(n, what)
        return _Reader(self.data, at, at + n, what)

    def section(self, tag: Section) -> _Reader:
        at = self.pos
        got = self.u8("section tag")
        if got != tag:
            known = {t.value: t.name for t in Section}
            detail = f"section {known[got]} out of order" if got in known else f"unknown section tag {got}"
            self.fail("section tag", f"{detail}; expected {tag.name}", at)
        n = self.u64(f"{tag.name} section length")
        return self.sub(n, f"{tag.name} section")

    def done(self) -> None:
        if self.pos != self.end:
            self.fail("end", f"{self.remaining} unread trailing bytes")


def _read_dtype(r: _Reader, what: str) -> str | None:
    at = r.pos
    code = r.u8(f"{what} dtype code")
    if code == _DTYPE_NONE:
        return None
    if code == _DTYPE_NAMED:
        name = r.text(f"{what} dtype name")
        if _dtype_code(name) is not None:
            r.fail(f"{what} dtype name", f"{name!r} must be stored by its code", at)
        return name
    try:
        return dtypes.from_onnx(code)
    except DTypeError:
        r.fail(f"{what} dtype code", f"unknown dtype code {code}", at)


def _read_dim(r: _Reader, what: str) -> Dim:
    at = r.pos
    tag = r.u8(f"{what} dimension tag")
    if tag == _Dim.NONE:
        return None
    if tag == _Dim.INT:
        return r.i64(f"{what} dimension")
    if tag == _Dim.STR:
        return r.text(f"{what} dimension name")
    r.fail(f"{what} dimension tag", f"unknown tag {tag}", at)


def _read_shape(r: _Reader, what: str) -> tuple[Dim, ...] | None:
    at = r.pos
    present = r.u8(f"{what} shape flag")
    if present == 0:
        return None
    if present != 1:
        r.fail(f"{what} shape flag", f"{present} is neither 0 (unknown) nor 1 (known)", at)
    rank = r.count(f"{what} rank", 1)
    return tuple(_read_dim(r, what) for _ in range(rank))


def _array_from(r: _Reader, dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int, what: str) -> np.ndarray:
    """A read-only array over the next ``nbytes`` bytes, after checking they fit ``shape``."""
    at = r.pos
    size = 1
    for d in shape:
        size *= d
    if size * dtype.itemsize != nbytes:
        r.fail(what, f"{nbytes} data bytes for {dtype}{list(shape)}, which needs {size * dtype.itemsize}", at)
    start = r.take(nbytes, what)
    try:
        arr = np.frombuffer(r.data, dtype=dtype, count=size, offset=start).reshape(shape)
    except ValueError as exc:  # numpy's own size limits (huge dims around a zero)
        r.fail(what, f"shape {list(shape)} is not allocatable: {exc}", at)
    if not arr.flags.aligned:
        arr = arr.copy()
        arr.flags.writeable = False
    return arr


def _read_array_dtype(r: _Reader, what: str) -> np.dtype[Any]:
    at = r.pos
    name = _read_dtype(r, what)
    if name is None or _dtype_code(name) is None:
        r.fail(f"{what} dtype code", "an array needs a known DSP dtype", at)
    return dtypes.to_numpy(name)


def _read_array(r: _Reader, what: str) -> np.ndarray:
    dtype = _read_array_dtype(r, what)
    at = r.pos
    rank = r.count(f"{what} rank", 8)
    if rank > _MAX_RANK:
        r.fail(f"{what} rank", f"rank {rank} exceeds {_MAX_RANK}", at)
    shape = tuple(_read_array_dim(r, what) for _ in range(rank))
    nbytes = r.u64(f"{what} byte length")
    return _array_from(r, dtype, shape, nbytes, what)


def _read_array_dim(r: _Reader, what: str) -> int:
    at = r.pos
    d = r.u64(f"{what} dimension")
    if d > _MAX_DIM:
        r.fail(f"{what} dimension", f"{d} exceeds {_MAX_DIM}", at)
    return d


def _read_scalar(r: _Reader, what: str) -> np.generic:
    dtype = _read_array_dtype(r, what)
    at = r.pos
    data = r.raw(dtype.itemsize, what)
    value: np.generic = np.frombuffer(data, dtype=dtype)[0]
    if value.tobytes() != data:
        r.fail(what, f"bytes {data.hex()} are not a canonical {dtype} scalar", at)
    return value


def _read_attr(r: _Reader, what: str, depth: int = 0) -> Any:
    at = r.pos
    tag = r.u8(f"{what} tag")
    if tag == AttrTag.NONE:
        return None
    if tag == AttrTag.INT:
        return r.i64(what)
    if tag == AttrTag.FLOAT:
        return r.f64(what)
    if tag == AttrTag.STR:
        return r.text(what)
    if tag == AttrTag.BOOL:
        return _read_bool(r, what)
    if tag == AttrTag.ARRAY:
        return _read_array(r, what)
    if tag == AttrTag.SCALAR:
        return _read_scalar(r, what)
    if tag in (AttrTag.LIST, AttrTag.TUPLE):
        if depth >= _MAX_ATTR_DEPTH:
            r.fail(what, f"lists nested deeper than {_MAX_ATTR_DEPTH}", at)
        items = [_read_attr(r, what, depth + 1) for _ in range(r.count(f"{what} length", 1))]
        return items if tag == AttrTag.LIST else tuple(items)
    r.fail(f"{what} tag", f"unknown attribute tag {tag}", at)


def _read_bool(r: _Reader, what: str) -> bool:
    at = r.pos
    v = r.u8(what)
    if v > 1:
        r.fail(what, f"boolean byte {v} is neither 0 nor 1", at)
    return v == 1


def _read_attrs(r: _Reader, where: str) -> MappingProxyType[str, Any]:
    attrs: dict[str, Any] = {}
    for _ in range(r.count(f"{where} attribute count", 5)):
        at = r.pos
        key = r.text(f"{where} attribute name")
        if key in attrs:
            r.fail(f"{where} attribute name", f"duplicate attribute {key!r}", at)
        attrs[key] = _read_attr(r, f"{where} attribute {key!r}")
    return MappingProxyType(attrs)


def _read_head(r: _Reader) -> tuple[str, str, bytes]:
    name = r.text("graph name")
    chash = r.text("content hash")
    meta = r.raw(_DIGEST, "meta digest")
    r.done()
    return name, chash, meta


def _read_ops(r: _Reader) -> list[tuple[str, str]]:
    ops: list[tuple[str, str]] = []
    for i in range(r.count("op count", 8)):
        at = r.pos
        entry = (r.text(f"op {i} domain"), r.text(f"op {i} name"))
        if not has_op(entry[1], entry[0]):
            r.fail(f"op {i}", f"op {entry[0] or 'ai.onnx'}::{entry[1]} is not in this build's op table", at)
        if entry in ops:
            r.fail(f"op {i}", f"duplicate op table entry {entry}", at)
        ops.append(entry)
    r.done()
    return ops


def _read_externals(r: _Reader) -> list[External]:
    externals: list[External] = []
    for k in range(r.count("external count", 7)):
        what = f"external {k}"
        name = r.text(f"{what} name")
        at = r.pos
        code = r.u8(f"{what} class")
        if code not in _CLASS_BY_CODE:
            r.fail(f"{what} class", f"unknown external class code {code}", at)
        externals.append(External(name, _CLASS_BY_CODE[code], _read_dtype(r, what), _read_shape(r, what)))
    r.done()
    return externals


def _read_values(r: _Reader) -> list[ValueInfo]:
    values: list[ValueInfo] = []
    for v in range(r.count("value count", 6)):
        what = f"value {v}"
        values.append(ValueInfo(r.text(f"{what} name"), _read_dtype(r, what), _read_shape(r, what)))
    r.done()
    return values


class _SlotReader:
    """Reads the SLOTS section, checking ops against the table and wiring against the plan."""

    def __init__(self, r: _Reader, ops: list[tuple[str, str]], n_externals: int, n_values: int) -> None:
        self.r = r
        self.ops = ops
        self.n_externals = n_externals
        self.n_values = n_values
        self.produced = 0  # values are numbered in slot order: the next output's id
        self.used: set[int] = set()

    def read(self) -> list[Slot]:
        slots = [self._slot(i) for i in range(self.r.count("slot count", 32))]
        if self.produced != self.n_values:
            self.r.fail("slots", f"slots produce {self.produced} values, the plan declares {self.n_values}")
        if len(self.used) != len(self.ops):
            self.r.fail("op table", f"{len(self.ops) - len(self.used)} entries no slot uses")
        self.r.done()
        return slots

    def _slot(self, i: int) -> Slot:
        r = self.r
        what = f"slot {i}"
        name = r.text(f"{what} name")
        at = r.pos
        index = r.u32(f"{what} op index")
        if index >= len(self.ops):
            r.fail(f"{what} op index", f"{index} is past the op table ({len(self.ops)} entries)", at)
        self.used.add(index)
        domain, op = self.ops[index]
        opset = r.i64(f"{what} opset")
        traits = self._traits(what, domain, op, opset)
        inputs = tuple(
            r.ref(f"{what} input", -self.n_externals, self.produced) for _ in range(r.count(f"{what} input count", 4))
        )
        outputs = tuple(self._output(what) for _ in range(r.count(f"{what} output count", 4)))
        attrs = _read_attrs(r, f"{what} ({name!r})")
        return Slot(i, op, domain, opset, name, inputs, outputs, attrs, traits)

    def _traits(self, what: str, domain: str, op: str, opset: int) -> Trait:
        r = self.r
        at = r.pos
        stored = r.u64(f"{what} traits")
        try:
            traits = lookup(op, domain, opset).traits
        except UnsupportedOpError as exc:
            r.fail(f"{what} op", str(exc), at)
        if traits.value != stored:
            r.fail(
                f"{what} traits",
                f"stored {stored} but {op} now has {traits.value} ({traits}): the op table "
                "changed since this plan was written; recompile",
                at,
            )
        return traits

    def _output(self, what: str) -> int | None:
        at = self.r.pos
        v = self.r.ref(f"{what} output", 0, self.n_values)
        if v is None:
            return None
        if v != self.produced:
            self.r.fail(f"{what} output", f"value {v} out of order; expected {self.produced}", at)
        self.produced += 1
        return v


def _read_outputs(r: _Reader, n_externals: int, n_values: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    refs: list[int] = []
    names: list[str] = []
    for i in range(r.count("output count", 8)):
        at = r.pos
        ref = r.ref(f"output {i}", -n_externals, n_values)
        if ref is None:
            r.fail(f"output {i}", "a requested output cannot be None", at)
        refs.append(ref)
        names.append(r.text(f"output {i} name"))
    r.done()
    return tuple(refs), tuple(names)


def _read_release(r: _Reader, n_slots: int, n_values: int) -> tuple[tuple[int, ...], ...]:
    at = r.pos
    n = r.count("release count", 4)
    if n != n_slots:
        r.fail("release count", f"{n} entries for {n_slots} slots", at)
    release = tuple(_read_value_ids(r, f"release of slot {i}", n_values) for i in range(n))
    r.done()
    return release


def _read_value_ids(r: _Reader, what: str, n_values: int) -> tuple[int, ...]:
    ids: list[int] = []
    for _ in range(r.count(f"{what} count", 4)):
        at = r.pos
        v = r.u32(what)
        if v >= n_values:
            r.fail(what, f"value id {v} out of range [0, {n_values})", at)
        ids.append(v)
    return tuple(ids)


class _ConstantReader:
    """Reads the CONSTANTS section: inline arrays, or references fetched with ``resolve``."""

    def __init__(
        self, r: _Reader, externals: list[External], resolve: Resolver | None, by_digest: WeightReader | None = None
    ) -> None:
        self.r = r
        self.externals = externals
        self.resolve = resolve
        self.by_digest = by_digest
        self.digests: dict[int, bytes] = {}  # by-reference constants, verified against their digest

    def read(self) -> dict[int, np.ndarray]:
        r = self.r
        constants: dict[int, np.ndarray] = {}
        last = -1
        for _ in range(r.count("constant count", 5)):
            at = r.pos
            k = r.u32("constant external index")
            if not last < k < len(self.externals):
                r.fail("constant external index", f"{k} is out of range or not increasing", at)
            last = k
            constants[k] = self._constant(self.externals[k], at, k)
        want = {k for k, e in enumerate(self.externals) if e.cls is ExternalClass.CONSTANT}
        if set(constants) != want:
            odd = sorted(want ^ set(constants))
            r.fail("constants", f"externals {odd} are CONSTANT without an array, or an array without CONSTANT")
        r.done()
        return constants

    def _layout(self, ext: External, at: int) -> tuple[np.dtype[Any], tuple[int, ...]]:
        """The dtype and shape a constant's array must have, from its external."""
        shape = ext.shape
        if ext.cls is not ExternalClass.CONSTANT or ext.dtype is None or _dtype_code(ext.dtype) is None:
            self.r.fail(f"constant {ext.name!r}", "its external is not a CONSTANT with a known dtype", at)
        if shape is None or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape) or len(shape) > _MAX_RANK:
            self.r.fail(f"constant {ext.name!r}", f"its external has no concrete shape ({shape})", at)
        return dtypes.to_numpy(ext.dtype), tuple(int(d) for d in shape)  # type: ignore[arg-type]

    def _constant(self, ext: External, at: int, k: int) -> np.ndarray:
        r = self.r
        dtype, shape = self._layout(ext, at)
        store_at = r.pos
        store = r.u8(f"constant {ext.name!r} storage")
        if store == _Store.INLINE:
            return _array_from(r, dtype, shape, r.u64(f"constant {ext.name!r} byte length"), f"constant {ext.name!r}")
        if store == _Store.REF:
            digest = r.raw(_DIGEST, f"constant {ext.name!r} digest")
            self.digests[k] = digest
            return self._resolved(ext, dtype, shape, digest)
        r.fail(f"constant {ext.name!r} storage", f"unknown storage code {store}", store_at)

    def _resolved(self, ext: External, dtype: np.dtype[Any], shape: tuple[int, ...], digest: bytes) -> np.ndarray:
        name = ext.name
        if self.by_digest is not None:
            found = self._from_store(name, dtype, shape, digest)
            if found is not None:  # by_digest vouches for the bytes: only the layout is checked here
                return self._checked(name, found, dtype, shape, digest, verify_bytes=False)
        if self.resolve is None:
            raise PlanFormatError(
                f"DSP1 plan stores constant {name!r} by reference; pass resolve= to loads "
                "(e.g. the model's initializers) or write the plan with a larger inline_limit"
            )
        try:
            arr = self.resolve(name)
        except DSPError:
            raise
        except Exception as exc:  # noqa: BLE001  (a caller's resolver must not escape as a non-DSP error)
            raise PlanFormatError(f"DSP1 plan: resolving constant {name!r} failed: {exc!r}") from exc
        if not isinstance(arr, np.ndarray):
            raise PlanFormatError(
                f"DSP1 plan: constant {name!r} is missing (resolve gave {type(arr).__name__}); "
                "the model no longer has it: recompile"
            )
        return self._checked(name, arr, dtype, shape, digest)

    def _from_store(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...], digest: bytes) -> np.ndarray | None:
        """The constant from ``by_digest`` (e.g. the cache's weight files) as a read-only array, or None.

        The store hands over bytes this process owns (never a mapping of a file another
        process may change); a store that fails is a miss, so ``resolve`` gets its turn.
        """
        assert self.by_digest is not None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        try:
            data = self.by_digest(digest.hex(), nbytes)
        except Exception as exc:  # noqa: BLE001  (a weight store must never fail a load)
            log.warning("DSP1 plan: weight store failed for constant %r (%r); reading it from the model", name, exc)
            return None
        if data is None or memoryview(data).nbytes != nbytes:
            return None
        arr = np.frombuffer(data, dtype=dtype).reshape(shape)
        arr.flags.writeable = False
        return arr

    def _checked(
        self,
        name: str,
        arr: np.ndarray,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        digest: bytes,
        verify_bytes: bool = True,
    ) -> np.ndarray:
        """``arr`` if it has the layout and the bytes the plan was written with."""
        if arr.dtype != dtype or arr.shape != shape:
            raise PlanFormatError(
                f"DSP1 plan: constant {name!r} is {arr.dtype}{list(arr.shape)} in the model, "
                f"the plan expects {dtype}{list(shape)}: recompile"
            )
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr).reshape(shape)
        if verify_bytes and constant_digest(arr) != digest:
            raise PlanFormatError(
                f"DSP1 plan: constant {name!r} has different bytes in the model than when "
                "the plan was written (digest mismatch): recompile"
            )
        return arr


class _Decoder:
    """Decodes plan records (recursively for regions) and verifies each one whole."""

    def __init__(self, resolve: Resolver | None, by_digest: WeightReader | None = None) -> None:
        self.resolve = resolve
        self.by_digest = by_digest

    def plan(self, r: _Reader, depth: int) -> Plan:
        start = r.pos
        if depth > _MAX_PLAN_DEPTH:
            r.fail("regions", f"sub-plans nested deeper than {_MAX_PLAN_DEPTH}")
        graph_name, chash, meta = _read_head(r.section(Section.HEAD))
        ops = _read_ops(r.section(Section.OPS))
        externals = _read_externals(r.section(Section.EXTERNALS))
        values = _read_values(r.section(Section.VALUES))
        slots = _SlotReader(r.section(Section.SLOTS), ops, len(externals), len(values)).read()
        outputs, names = _read_outputs(r.section(Section.OUTPUTS), len(externals), len(values))
        release = _read_release(r.section(Section.RELEASE), len(slots), len(values))
        reader = _ConstantReader(r.section(Section.CONSTANTS), externals, self.resolve, self.by_digest)
        constants = reader.read()
        regions = self.regions(r.section(Section.REGIONS), slots, depth)
        gaps = _read_capture_gaps(r.section(Section.CAPTURE_GAPS), len(slots)) if r.remaining else {}
        r.done()
        plan = Plan(
            tuple(slots),
            tuple(externals),
            tuple(values),
            outputs,
            names,
            release,
            constants,
            chash,
            graph_name,
            regions,
            constant_digests=dict(reader.digests),  # verified once in _resolved: not hashed again
            capture_gaps=gaps,
        )
        _verify(r, plan, meta, start)
        return plan

    def regions(self, r: _Reader, slots: list[Slot], depth: int) -> dict[int, Region]:
        regions: dict[int, Region] = {}
        last = -1
        for _ in range(r.count("region count", 16)):
            at = r.pos
            k = r.u32("region slot")
            if not last < k < len(slots):
                r.fail("region slot", f"{k} is out of range or not increasing", at)
            last = k
            regions[k] = self.region(r, k, slots[k], depth)
        r.done()
        return regions

    def region(self, r: _Reader, k: int, slot: Slot, depth: int) -> Region:
        at = r.pos
        kind = r.text(f"region {k} kind")
        if kind != slot.op:
            r.fail(f"region {k} kind", f"{kind!r} but slot {k} runs {slot.op!r}", at)
        outer = tuple(r.text(f"region {k} outer name") for _ in range(r.count(f"region {k} outer count", 4)))
        subplans: dict[str, Plan] = {}
        for _ in range(r.count(f"region {k} sub-plan count", 12)):
            at = r.pos
            attr = r.text(f"region {k} sub-plan attribute")
            if attr in subplans:
                r.fail(f"region {k} sub-plan attribute", f"duplicate {attr!r}", at)
            sub = r.sub(r.u64(f"region {k} sub-plan length"), f"sub-plan {attr!r} of slot {k}")
            subplans[attr] = self.plan(sub, depth + 1)
        return Region(k, kind, subplans, outer)


def _verify(r: _Reader, plan: Plan, meta: bytes, start: int) -> None:
    """Reject a decoded plan whose digests differ from the ones written with it."""
    got = content_hash(plan)
    if got != plan.content_hash:
        r.fail("content hash", f"stored {plan.content_hash!r}, the decoded plan hashes to {got!r}", start)
    if _meta_digest(plan) != meta:
        r.fail(
            "meta digest",
            "the decoded names, static shapes, traits, liveness or attributes differ from those written",
            start,
        )


def _read_header(data: bytes, verify_checksum: bool) -> _Reader:
    r = _Reader(data, 0, len(data), "header")
    magic = r.raw(4, "magic")
    if magic != MAGIC:
        r.fail("magic", f"{magic!r} is not {MAGIC!r}: not a DSP1 plan file", 0)
    version = int(r.unpack(_U16, "version"))
    if version != VERSION:
        r.fail("version", f"format version {version}, this build reads version {VERSION}: recompile", 4)
    flags = int(r.unpack(_U16, "flags"))
    if flags != 0:
        r.fail("flags", f"reserved flags {flags:#06x} must be 0", 6)
    length = r.u64("payload length")
    checksum = r.raw(_DIGEST, "checksum")
    if length != r.remaining:
        r.fail("payload length", f"header says {length} bytes, the file holds {r.remaining}", 8)
    payload = r.sub(length, "payload")
    if verify_checksum and _blake16(memoryview(data)[payload.pos :]) != checksum:
        r.fail("checksum", "payload does not match its blake2b checksum (corrupt or truncated file)", 16)
    return payload


def referenced_weights(data: bytes | bytearray | memoryview) -> list[tuple[str, int]]:
    """The by-reference constants of a DSP1 plan's top-level record: (digest hex, byte length), in the
    order ``loads`` asks its ``by_digest`` for them.

    A hint for reading them ahead (``DiskCache.prefetch``): it checks nothing (no checksum,
    no digest of the plan) and a malformed plan gives what was found before the fault, or
    nothing; ``loads`` judges the plan. Constants of control-flow regions are not listed.
    """
    found: list[tuple[str, int]] = []
    try:
        payload = _read_header(bytes(data), verify_checksum=False)
        for tag in (Section.HEAD, Section.OPS):
            payload.section(tag)
        externals = _read_externals(payload.section(Section.EXTERNALS))
        for tag in (Section.VALUES, Section.SLOTS, Section.OUTPUTS, Section.RELEASE):
            payload.section(tag)
        r = payload.section(Section.CONSTANTS)
        for _ in range(r.count("constant count", 5)):
            ext = externals[r.u32("constant external index")]
            store = r.u8("constant storage")
            if store == _Store.INLINE:
                r.take(r.u64("constant byte length"), "constant bytes")
                continue
            if store != _Store.REF:
                break
            digest = r.raw(_DIGEST, "constant digest")
            dims = [d for d in ext.shape or () if type(d) is int]
            if ext.dtype is None or ext.shape is None or len(dims) != len(ext.shape):
                continue
            size = int(np.prod(dims, dtype=np.int64)) * dtypes.to_numpy(ext.dtype).itemsize
            found.append((digest.hex(), size))
    except Exception:  # noqa: BLE001  (a hint only: loads reports what is wrong with the plan)
        pass
    return found


def loads(
    data: bytes,
    *,
    resolve: Resolver | None = None,
    by_digest: WeightReader | None = None,
    _verify_checksum: bool = True,
) -> Plan:
    """Parse DSP1 bytes into a Plan; by-reference constants come from ``by_digest(digest hex, nbytes)``
    (e.g. the disk cache's weight files, which must return only bytes whose digest they
    verified, read into memory this process owns) or ``resolve(name)`` (e.g. the model's
    initializers, checked here)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PlanFormatError(f"DSP1 data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    payload = _read_header(data, _verify_checksum)
    plan = _Decoder(resolve, by_digest).plan(payload, 0)
    payload.done()
    return plan
