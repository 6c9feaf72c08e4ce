"""Parse an ONNX model without holding its weights twice: big initializers go straight to numpy.

``ParseFromString`` needs the whole file in memory, then keeps its own copy of every
tensor's bytes, and reading ``raw_data`` copies them once more: three times the weights
at the peak. This reader walks the protobuf wire format of the model and of its graph
instead. Every field is still parsed by protobuf (merged in file order, so the message
is the one ``ParseFromString`` would build), except the ``raw_data`` of each large
initializer of the top-level graph: that is read from the file directly into a numpy
buffer, and the tensor is left in the proto without data, its array handed back beside
it (``arrays[index in graph.initializer]``). Such an array is exactly what
``numpy_helper.to_array`` gives (the same bytes, dtype and shape, read-only).

Anything unexpected (a malformed or overlong varint, a group, a field running past its
message, a tensor whose array is not simply its raw bytes) makes the reader give up
(``None``), and the caller parses the model the ordinary way, which reports the error as
it always did. This is only a faster road to the same result.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper

from dsp_core.errors import DTypeError
from dsp_core.ir import dtypes

BIG = 1 << 16  # raw_data of at least this many bytes is read straight into an array
_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
# Element types whose raw bytes are packed below one byte per element (to_array unpacks them).
_PACKED = {
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2", "FLOAT6E2M3", "FLOAT6E3M2")
    if hasattr(onnx.TensorProto, name)
}

Progress = Callable[[int], None]  # called with the number of bytes just consumed


class _GiveUp(Exception):
    """The input is not what this reader handles; parse it the ordinary way."""


def direct_dtype(t: onnx.TensorProto) -> np.dtype | None:
    """The numpy dtype whose buffer of the tensor's raw bytes *is* its array, or None.

    None for what ``numpy_helper.to_array`` converts rather than views: strings, packed
    sub-byte types, element types DSP does not support (import raises for those),
    segments, big-endian hosts.
    """
    if sys.byteorder != "little" or t.HasField("segment") or t.data_type in _PACKED:
        return None
    if t.data_type == onnx.TensorProto.STRING:
        return None
    try:
        dtypes.from_onnx(t.data_type)
        np_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    except (DTypeError, KeyError, TypeError, ValueError):
        return None
    return None if np_dtype.hasobject or np_dtype.itemsize == 0 else np_dtype


def as_array(t: onnx.TensorProto, buf: np.ndarray) -> np.ndarray | None:
    """``buf`` (uint8, the tensor's raw bytes) as the tensor's read-only array; None if it is not that."""
    np_dtype = direct_dtype(t)
    if np_dtype is None or any(d < 0 for d in t.dims):
        return None
    if math.prod(t.dims) * np_dtype.itemsize != buf.nbytes:
        return None  # the ordinary path raises its own error for a size that does not fit
    arr = buf.view(np_dtype).reshape(tuple(t.dims))
    arr.flags.writeable = False
    return arr


def read_model(
    f: BinaryIO, size: int, progress: Progress | None = None, skip_weights: bool = False
) -> tuple[onnx.ModelProto, dict[int, np.ndarray]] | None:
    """(model, arrays) read from ``f`` (``size`` bytes), or None when the reader gave up.

    ``skip_weights``: seek past the big raw_data instead of reading it (for a caller that
    needs only the model's structure, such as the external-data locations it names).
    """
    r = _Reader(f, size, progress)
    model = onnx.ModelProto()
    arrays: dict[int, np.ndarray] = {}
    rest = bytearray()
    try:
        while r.pos < size:
            number, wire, tag = r.tag()
            if number == _GRAPH and wire == 2:
                n = r.varint()
                end = r.pos + n
                r.check_end(end, size)
                _graph(r, end, model.graph, arrays, skip_weights)
            else:
                rest += tag + r.field_rest(wire)
        model.MergeFromString(bytes(rest))
    except (_GiveUp, DecodeError, RuntimeError, ValueError, OSError):
        return None
    return model, arrays


def _graph(r: _Reader, end: int, graph: onnx.GraphProto, arrays: dict[int, np.ndarray], skip: bool) -> None:
    rest = bytearray()
    while r.pos < end:
        number, wire, tag = r.tag()
        if number == _INITIALIZER and wire == 2:
            n = r.varint()
            tensor_end = r.pos + n
            r.check_end(tensor_end, end)
            _initializer(r, tensor_end, graph, arrays, skip)
        else:
            rest += tag + r.field_rest(wire)
    r.check_end(r.pos, end)
    graph.MergeFromString(bytes(rest))


def _initializer(r: _Reader, end: int, graph: onnx.GraphProto, arrays: dict[int, np.ndarray], skip: bool) -> None:
    rest = bytearray()
    big: np.ndarray | None = None
    skipped = False
    while r.pos < end:
        number, wire, tag = r.tag()
        if number == _RAW_DATA and wire == 2:
            n = r.varint()
            r.check_end(r.pos + n, end)
            if n >= BIG:
                big, skipped = (None, r.skip(n)) if skip else (r.array(n), False)
                continue
            big, skipped = None, False  # a later raw_data wins, as in protobuf
            rest += tag + _varint_bytes(n) + r.read(n)
        else:
            rest += tag + r.field_rest(wire)
    r.check_end(r.pos, end)
    t = graph.initializer.add()
    t.MergeFromString(bytes(rest))
    if skipped or big is None:
        return
    arr = None if t.HasField("raw_data") or t.data_location != onnx.TensorProto.DEFAULT else as_array(t, big)
    if arr is None:
        t.raw_data = big.tobytes()  # not an array as it stands: the tensor exactly as protobuf has it
    else:
        arrays[len(graph.initializer) - 1] = arr


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


class _Reader:
    """Sequential reads of a binary stream, with the position and the progress kept."""

    def __init__(self, f: BinaryIO, size: int, progress: Progress | None) -> None:
        self.f, self.size, self.pos = f, size, 0
        self.progress = progress
        self._unreported = 0

    def _consumed(self, n: int) -> None:
        self.pos += n
        if self.progress is not None:
            self._unreported += n
            if self._unreported >= 1 << 22:
                self.progress(self._unreported)
                self._unreported = 0

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise _GiveUp("truncated")
        self._consumed(n)
        return data

    def skip(self, n: int) -> bool:
        self.f.seek(n, io.SEEK_CUR)
        self._consumed(n)
        return True

    def array(self, n: int) -> np.ndarray:
        """The next ``n`` bytes read into a fresh uint8 array (no intermediate copy)."""
        buf = np.empty(n, np.uint8)
        view = buf.data
        got = 0
        while got < n:
            k = self.f.readinto(view[got : min(n, got + (1 << 26))])  # type: ignore[attr-defined]
            if not k:
                raise _GiveUp("truncated")
            got += k
            self._consumed(k)
        return buf

    def varint(self) -> int:
        return self._varint()[0]

    def _varint(self) -> tuple[int, bytes]:
        raw = bytearray()
        value = shift = 0
        while True:
            b = self.f.read(1)
            if not b:
                raise _GiveUp("truncated varint")
            raw += b
            value |= (b[0] & 0x7F) << shift
            if not b[0] & 0x80:
                break
            shift += 7
            if shift >= 64:
                raise _GiveUp("overlong varint")
        self._consumed(len(raw))
        return value, bytes(raw)

    def tag(self) -> tuple[int, int, bytes]:
        """(field number, wire type, the tag's own bytes)."""
        value, raw = self._varint()
        if value >> 3 == 0:
            raise _GiveUp("field number 0")
        return value >> 3, value & 7, raw

    def field_rest(self, wire: int) -> bytes:
        """The encoded remainder of a field after its tag: what protobuf reads for it."""
        if wire == 0:
            return self._varint()[1]
        if wire == 1:
            return self.read(8)
        if wire == 5:
            return self.read(4)
        if wire == 2:
            n, raw = self._varint()
            self.check_end(self.pos + n, self.size)
            return raw + self.read(n)
        raise _GiveUp(f"wire type {wire}")

    def check_end(self, end: int, limit: int) -> None:
        if end > limit:
            raise _GiveUp("a field runs past its message")
