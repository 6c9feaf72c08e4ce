"""Triton as a compiler only: each kernel's cubin kept in DSP's cache, loaded with CuPy, launched by DSP.

Triton's own way to a launch (``JITFunction.warmup``, ``CompiledKernel``, its C launcher)
goes through its NVIDIA driver, which imports torch on first use (over a second of a warm
start) and hashes Triton's installed sources once per process (half a second). A warm
start needs none of it. Once Triton has compiled a kernel, its cubin and the little of its
metadata a launch needs are stored under ``<DSP cache>/triton/cubin`` as checked files
(digest beside, atomic writes: a damaged entry is compiled again, never loaded); the key
covers the source, ``num_warps``, the dependent launch, which pointers were 16-byte
aligned (Triton specialises on that), the device's capability and Triton's version. A
later process loads the cubin with ``cuModuleLoadData`` (CuPy) and launches it through
dsp-cuda-graphs' ``cuLaunchKernelEx`` binding: no Triton import, no torch.

The launch ABI (Triton 3.4-3.6, the versions dsp-triton accepts): the kernel's
non-constexpr parameters in order (every DSP kernel takes pointers only), then the
``global_scratch`` and ``profile_scratch`` pointers (NULL: only kernels that need neither
are stored), ``32 * num_warps`` threads in x, ``metadata.shared`` bytes of dynamic shared
memory (opted in above 48 KiB), one CTA per cluster. A kernel outside that (scratch,
clusters, a cooperative grid, tensor descriptors) keeps Triton's own launcher.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsp_cuda_graphs.launch import launch_pointers

from dsp_triton.cache import cache_root, read_checked, write_checked

DEFAULT_SHARED = 48 * 1024  # dynamic shared memory a kernel may use without opting in
FORMAT = 1  # the stored entry's layout
MAX_THREADS_PER_BLOCK = 0  # CUfunction_attribute
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@functools.cache
def triton_version() -> str:
    """The installed Triton's version, read from its distribution's metadata (no import)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "none"


@functools.cache
def has_dependent_launch() -> bool:
    """Whether the installed Triton has ``tl.extra.cuda.gdc_wait`` and ``gdc_launch_dependents``.

    Read from the installed module's source where it can be found, so a warm start (whose
    kernels all come from the cubin cache) never imports Triton; else by importing it.
    """
    from importlib import metadata

    try:
        text = Path(str(metadata.distribution("triton").locate_file("triton/language/extra/cuda/gdc.py"))).read_text()
    except (metadata.PackageNotFoundError, OSError):
        text = None
    if text is not None:
        return "def gdc_wait(" in text and "def gdc_launch_dependents(" in text
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


@dataclass(frozen=True)
class Cubin:
    """A compiled kernel as DSP launches it."""

    name: str  # the entry point in the cubin
    num_warps: int
    shared: int  # dynamic shared memory, bytes
    pdl: bool  # launched as a programmatic dependent of the kernel before it
    image: bytes


def entry_key(source: str, num_warps: int, pdl: bool, aligned: Sequence[bool], arch: str, dtypes: Sequence[str]) -> str:
    """The cache key of one kernel's cubin on a device of capability ``arch``.

    ``dtypes`` are the arguments' element types, in order: a generated source does not always
    name them (a comparison's loads read whatever its pointers point to), and Triton compiles
    each pointer's type into the binary, so one source over float32 and over int16 inputs is
    two binaries.
    """
    mask = "".join("1" if a else "0" for a in aligned)
    sig = ",".join(dtypes)
    text = f"{FORMAT}\0{triton_version()}\0sm{arch}\0{num_warps}\0{int(pdl)}\0{mask}\0{sig}\0{source}"
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def from_compiled(binary: Any) -> Cubin | None:
    """What DSP needs of a Triton ``CompiledKernel`` to launch it; None when it is outside the ABI above."""
    md = binary.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False):
        return None
    if getattr(md, "tensordesc_meta", None):
        return None
    image = binary.asm.get("cubin") if hasattr(binary.asm, "get") else None
    if not isinstance(image, bytes | bytearray) or not image:
        return None
    return Cubin(str(md.name), int(md.num_warps), int(md.shared), bool(getattr(md, "launch_pdl", False)), bytes(image))


class CubinCache:
    """Cubins by ``entry_key``: ``<key>.json`` (the launch metadata) and ``<key>.cubin``, both checked."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or cache_root()) / "cubin"

    def get(self, key: str) -> Cubin | None:
        raw = read_checked(self.root / f"{key}.json")
        if raw is None:
            return None
        image = read_checked(self.root / f"{key}.cubin")
        if image is None:
            return None
        try:
            meta = json.loads(raw)
            got = Cubin(str(meta["name"]), int(meta["num_warps"]), int(meta["shared"]), bool(meta["pdl"]), image)
        except (ValueError, KeyError, TypeError):
            return None
        return got if meta.get("format") == FORMAT else None

    def put(self, key: str, cubin: Cubin) -> None:
        meta = {"format": FORMAT, "name": cubin.name, "num_warps": cubin.num_warps, "shared": cubin.shared}
        meta["pdl"] = cubin.pdl
        try:
            write_checked(self.root / f"{key}.cubin", cubin.image)  # the image first: the JSON means complete
            write_checked(self.root / f"{key}.json", json.dumps(meta, sort_keys=True).encode())
        except OSError:
            pass  # an unwritable cache only costs a compile next time


_OPTIN: dict[int, int] = {}


def _shared_optin(cp: Any) -> int:
    """The most dynamic shared memory a block of the current device may opt in to (0: unknown)."""
    dev = cp.cuda.Device()
    if dev.id not in _OPTIN:
        try:
            _OPTIN[dev.id] = int(dev.attributes.get("MaxSharedMemoryPerBlockOptin", 0))
        except Exception:  # noqa: BLE001
            _OPTIN[dev.id] = 0
    return _OPTIN[dev.id]


class Loaded:
    """A cubin loaded on the current device (``cuModuleLoadData``), launched through ``cuLaunchKernelEx``."""

    def __init__(self, cp: Any, cubin: Cubin) -> None:
        self.cubin = cubin
        self.module = cp.cuda.function.Module()  # kept: the function lives as long as its module
        self.module.load(cubin.image)
        self.function = self.module.get_function(cubin.name)
        self.threads = 32 * cubin.num_warps
        driver = cp.cuda.driver
        optin = _shared_optin(cp)
        if optin and cubin.shared > optin:  # the driver would answer CUDA_ERROR_INVALID_VALUE
            raise RuntimeError(f"{cubin.name}: {cubin.shared} bytes of shared memory, the device allows {optin}")
        if cubin.shared > DEFAULT_SHARED:
            driver.funcSetAttribute(self.function.ptr, MAX_DYNAMIC_SHARED_SIZE_BYTES, cubin.shared)
        most = int(driver.funcGetAttribute(MAX_THREADS_PER_BLOCK, self.function.ptr))
        if self.threads > most:
            raise RuntimeError(f"{cubin.name}: {self.threads} threads a block, its registers allow {most}")

    def launch(self, grid: tuple[int, int, int], pointers: Sequence[int], stream: int) -> None:
        launch_pointers(
            self.function,
            grid,
            self.threads,
            [*pointers, 0, 0],  # global_scratch, profile_scratch: none
            stream,
            shared=self.cubin.shared,
            dependent=self.cubin.pdl,
        )


class TritonLaunched:
    """A kernel DSP's loader does not take, on Triton's own launcher (its module loaded now, never
    inside a capture)."""

    def __init__(self, binary: Any) -> None:
        binary._init_handles()
        self.binary = binary

    def launch(self, grid: tuple[int, int, int], pointers: Sequence[int], stream: int) -> None:
        self.binary[grid](*pointers, stream=stream)


__all__ = [
    "Cubin",
    "CubinCache",
    "Loaded",
    "TritonLaunched",
    "entry_key",
    "from_compiled",
    "has_dependent_launch",
    "triton_version",
]
