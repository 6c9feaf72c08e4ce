"""Compile PTX_JIT's hand-written kernels (plugins/nvrtc/dsp_nvrtc/ptx/rowwise.cu) into the committed PTX.

Needs NVRTC 13.0 (``pip install nvidia-cuda-nvrtc==13.0.88``, the ``dsp-nvrtc[nvrtc]`` extra),
no GPU: PTX of ISA 9.0 loads on every CUDA 13 driver. ``--check`` compares instead of
writing and exits 1 when the committed PTX is stale.
"""

from __future__ import annotations

import argparse
import sys

from dsp_nvrtc import compiler, rowwise


def build() -> bytes:
    """The PTX text of rowwise.cu, as committed (without the trailing NUL)."""
    ptx = compiler.compile_source(rowwise.translation_unit(), "rowwise", compiler.Target(rowwise.ARCH))
    return ptx.rstrip(b"\0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed PTX; write nothing")
    args = parser.parse_args()
    major, minor = compiler.version()
    if (major, minor) != (13, 0):
        print(f"NVRTC {major}.{minor} found; the committed PTX is built with 13.0 (its drivers load it)")
        return 2
    ptx = build()
    if args.check:
        same = rowwise.PTX.read_bytes() == ptx
        print(f"{rowwise.PTX}: {'up to date' if same else 'STALE: run scripts/build_ptx.py'}")
        return 0 if same else 1
    rowwise.PTX.write_bytes(ptx)
    print(f"wrote {rowwise.PTX} ({len(ptx)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
