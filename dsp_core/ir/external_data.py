"""External tensor data, read safely: inside the model's directory, bounded, regular files only.

ONNX lets a tensor keep its bytes in a file beside the model (``data_location =
EXTERNAL`` with ``location``/``offset``/``length`` keys). A model from an untrusted
source must not be able to read anything else: the location must be a relative path
that stays inside the model's directory (no ``..``, no absolute path, no symlink that
leads out), the file must be a regular file (a FIFO would block forever, ``/dev/zero``
never ends), and exactly the tensor's declared size is read. Bytes and protos have no
directory, so their external data needs an explicit ``base_dir``: the meaning of a model
never depends on the process's current directory.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from dsp_core import progress
from dsp_core.errors import ModelLoadError
from dsp_core.ir.onnx_scan import as_array, direct_dtype

# Bits per element of every ONNX element type with a fixed size (strings have none).
_BITS: dict[int, int] = {
    onnx.TensorProto.FLOAT: 32,
    onnx.TensorProto.UINT8: 8,
    onnx.TensorProto.INT8: 8,
    onnx.TensorProto.UINT16: 16,
    onnx.TensorProto.INT16: 16,
    onnx.TensorProto.INT32: 32,
    onnx.TensorProto.INT64: 64,
    onnx.TensorProto.BOOL: 8,
    onnx.TensorProto.FLOAT16: 16,
    onnx.TensorProto.DOUBLE: 64,
    onnx.TensorProto.UINT32: 32,
    onnx.TensorProto.UINT64: 64,
    onnx.TensorProto.COMPLEX64: 64,
    onnx.TensorProto.COMPLEX128: 128,
    onnx.TensorProto.BFLOAT16: 16,
}
for _name, _bits in (
    ("FLOAT8E4M3FN", 8),
    ("FLOAT8E4M3FNUZ", 8),
    ("FLOAT8E5M2", 8),
    ("FLOAT8E5M2FNUZ", 8),
    ("FLOAT8E8M0", 8),
    ("UINT4", 4),
    ("INT4", 4),
    ("FLOAT4E2M1", 4),
    ("UINT2", 2),
    ("INT2", 2),
):
    if hasattr(onnx.TensorProto, _name):
        _BITS[getattr(onnx.TensorProto, _name)] = _bits


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model (initializers and attribute tensors, subgraphs included) stored externally."""
    stack = [model.graph]
    while stack:
        g = stack.pop()
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                yield t
        for sparse in g.sparse_initializer:
            for t in (sparse.values, sparse.indices):
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    yield t
        for node in g.node:
            for attr in node.attribute:
                tensors = [attr.t] if attr.HasField("t") else []
                tensors += list(attr.tensors)
                for t in tensors:
                    if t.data_location == onnx.TensorProto.EXTERNAL:
                        yield t
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def load_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike[str] | None, where: str) -> onnx.ModelProto:
    """``model`` with every external tensor's bytes read in; a copy if the proto had to change.

    ``base_dir`` is the directory the locations are relative to (None: the model came
    without one, so external data is an error that says how to give it).
    """
    return read_external_data(model, base_dir, where, None)


def read_external_data(
    model: onnx.ModelProto,
    base_dir: str | os.PathLike[str] | None,
    where: str,
    arrays: dict[int, np.ndarray] | None,
) -> onnx.ModelProto:
    """As :func:`load_external_data`; with ``arrays``, top-level initializers are read straight into arrays.

    Each external initializer of the top-level graph whose array is its raw bytes
    (``onnx_scan.direct_dtype``) is read from its file into a numpy buffer, stored in
    ``arrays[index]`` and left without data in the returned proto, so its bytes are in
    memory once (never in the proto as well). Every check is the same either way.
    """
    if next(external_tensors(model), None) is None:
        return model
    if base_dir is None:
        first = next(external_tensors(model))
        raise ModelLoadError(
            f"{where}: tensor {first.name!r} keeps its data in an external file, and a model given as "
            "bytes or a proto has no directory to find it in: pass base_dir= (the directory that holds "
            "the data files), or compile the model from its path"
        )
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # never change the caller's proto
    root = Path(os.path.realpath(base_dir))
    if arrays is not None:
        direct = [
            (i, t)
            for i, t in enumerate(copy.graph.initializer)
            if t.data_location == onnx.TensorProto.EXTERNAL and direct_dtype(t) is not None
        ]
        total = sum(declared_bytes(t) or 0 for _, t in direct)  # for the progress bar only: checked per tensor below
        with progress.step("load external data", total=total, unit="B") as bar:
            for i, tensor in direct:
                buf = _read(tensor, root, where, into_array=True)
                assert isinstance(buf, np.ndarray)
                arr = as_array(tensor, buf)
                if arr is None:  # its dims do not fit its bytes: keep them in the proto, import says why
                    tensor.raw_data = buf.tobytes()
                else:
                    arrays[i] = arr
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
                bar.advance(buf.nbytes)
    for tensor in external_tensors(copy):
        data = _read(tensor, root, where)
        assert isinstance(data, bytes)
        tensor.raw_data = data
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return copy


def _read(tensor: onnx.TensorProto, root: Path, where: str, into_array: bool = False) -> bytes | np.ndarray:
    """The tensor's external bytes (``into_array``: as a fresh uint8 array), every check applied."""
    info = {e.key: e.value for e in tensor.external_data}
    name = tensor.name or "(unnamed)"
    location = info.get("location", "")
    path = _inside(root, location, f"{where}: tensor {name!r}")
    offset = _int_field(info, "offset", 0, where, name)
    size = _expected_size(tensor, where, name)
    length = _int_field(info, "length", size, where, name)
    if length != size:
        raise ModelLoadError(
            f"{where}: tensor {name!r} declares {length} bytes of external data, but its dims and type need {size}"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ModelLoadError(
            f"{where}: tensor {name!r}: cannot open external data {location!r} in {root}: {exc.strerror}; "
            "keep the data file beside the model (or pass base_dir= the folder that holds it)"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelLoadError(f"{where}: tensor {name!r}: external data {location!r} is not a regular file")
        if offset + length > st.st_size:
            raise ModelLoadError(
                f"{where}: tensor {name!r}: external data {location!r} has {st.st_size} bytes, "
                f"the tensor needs bytes {offset}..{offset + length}"
            )
        data: bytes | np.ndarray
        if into_array:
            data, got = _pread_array(fd, length, offset)
        else:
            data = os.pread(fd, length, offset)
            got = len(data)
    except OSError as exc:
        raise ModelLoadError(f"{where}: tensor {name!r}: cannot read external data {location!r}: {exc}") from None
    finally:
        os.close(fd)
    if got != length:
        raise ModelLoadError(f"{where}: tensor {name!r}: external data {location!r} ended early")
    return data


def _pread_array(fd: int, length: int, offset: int) -> tuple[np.ndarray, int]:
    """(a uint8 array of ``length`` bytes read at ``offset``, how many were read: fewer if the file ended)."""
    buf = np.empty(length, np.uint8)
    view = buf.data
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got : min(length, got + (1 << 30))]], offset + got)
        if n == 0:
            break
        got += n
    return buf, got


def _inside(root: Path, location: str, what: str) -> Path:
    """The resolved path of ``location`` under ``root``; ModelLoadError if it leads anywhere else."""
    if not location:
        raise ModelLoadError(f"{what} is stored externally but names no location")
    rel = Path(location)
    if rel.is_absolute() or location.startswith(("/", "\\")) or ".." in rel.parts or "\x00" in location:
        raise ModelLoadError(
            f"{what}: external data location {location!r} must be a relative path inside the model's "
            f"directory ({root}), without '..'"
        )
    resolved = Path(os.path.realpath(root / rel))
    if resolved != root and root not in resolved.parents:
        raise ModelLoadError(f"{what}: external data location {location!r} leads outside {root} (through a link)")
    return resolved


def _int_field(info: dict[str, str], key: str, default: int, where: str, name: str) -> int:
    if key not in info:
        return default
    try:
        value = int(info[key])
    except ValueError:
        raise ModelLoadError(f"{where}: tensor {name!r}: external data {key} {info[key]!r} is not an integer") from None
    if value < 0:
        raise ModelLoadError(f"{where}: tensor {name!r}: external data {key} {value} is negative")
    return value


def declared_bytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes the tensor's dims and element type need; None for strings, unknown types, negative dims."""
    bits = _BITS.get(tensor.data_type)
    if bits is None or any(d < 0 for d in tensor.dims):
        return None
    return math.ceil(math.prod(tensor.dims) * bits / 8)


def _expected_size(tensor: onnx.TensorProto, where: str, name: str) -> int:
    bits = _BITS.get(tensor.data_type)
    if bits is None:
        raise ModelLoadError(
            f"{where}: tensor {name!r} of element type {tensor.data_type} cannot be stored as external data"
        )
    if any(d < 0 for d in tensor.dims):
        raise ModelLoadError(f"{where}: tensor {name!r} has a negative dim {list(tensor.dims)}")
    return math.ceil(math.prod(tensor.dims) * bits / 8)
