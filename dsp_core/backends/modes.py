"""Execution modes, the platforms they run on, and AUTO's fallback chains."""

from __future__ import annotations

import enum

from dsp_core.errors import ConfigError


class GraphExecutionMode(enum.Enum):
    """How a plan (or a segment of it) executes. AUTO picks per segment."""

    AUTO = "auto"
    SLOT_BY_SLOT = "slot_by_slot"
    CUDA_GRAPHS = "cuda_graphs"
    TRITON = "triton"
    NVRTC_JIT = "nvrtc_jit"
    PTX_JIT = "ptx_jit"
    EMULATED_REPLAY = "emulated_replay"
    NUMPY_REPLAY = "numpy_replay"
    SHAPE_INFERENCE_ONLY = "shape_inference_only"
    HIP_GRAPHS = "hip_graphs"
    LEVEL_ZERO = "level_zero"
    VULKAN = "vulkan"
    METAL = "metal"
    MLX = "mlx"
    NNAPI = "nnapi"
    ARM_HYBRID = "arm_hybrid"
    MLIR_CPU_JIT = "mlir_cpu_jit"
    ONEDNN = "onednn"
    OPENVINO = "openvino"
    ONNXRUNTIME = "onnxruntime"
    ACL = "acl"

    @classmethod
    def parse(cls, value: str | GraphExecutionMode) -> GraphExecutionMode:
        """A mode from its enum value or its name, in any case ("slot_by_slot", "CUDA_GRAPHS")."""
        if isinstance(value, GraphExecutionMode):
            return value
        key = str(value).strip().upper().replace("-", "_")
        try:
            return cls[key]
        except KeyError:
            allowed = ", ".join(m.name.lower() for m in cls)
            raise ConfigError(f"unknown execution mode {value!r}; allowed: {allowed}") from None


M = GraphExecutionMode

# Which distribution of this repository provides each mode, for "install X" remedies.
# Only distributions this repository builds (plugins/*/pyproject.toml, `make dist`) are
# named: a remedy must never send a user to a package that does not exist.
# tests/test_packaging.py checks this table against the plugins' metadata.
PROVIDERS: dict[GraphExecutionMode, str] = {
    M.SLOT_BY_SLOT: "dsp-cpu-ref",
    M.EMULATED_REPLAY: "dsp-cpu-ref",
    M.NUMPY_REPLAY: "dsp-cpu-ref",
    M.SHAPE_INFERENCE_ONLY: "dsp-cpu-ref",
    M.CUDA_GRAPHS: "dsp-cuda-graphs",
    M.TRITON: "dsp-triton",
    M.NVRTC_JIT: "dsp-nvrtc",
    M.PTX_JIT: "dsp-nvrtc",
    M.OPENVINO: "dsp-openvino",
    M.ONNXRUNTIME: "dsp-onnxruntime",
}

# AUTO's preference order per platform: the first available backend that supports a
# slot takes it; SLOT_BY_SLOT (the reference) takes whatever is left. Where several
# available backends take a segment, a timed trial at freeze picks the fastest
# (dsp_core/backends/auction.py, DSP_AUCTION_TRIALS); this order breaks ties. On the CPU,
# ONNXRUNTIME comes right after OPENVINO: both run a whole segment as one model of a
# mature runtime, ahead of the JIT modes that have no distribution here yet.
FALLBACK_CHAINS: dict[str, tuple[GraphExecutionMode, ...]] = {
    "cuda": (M.TRITON, M.NVRTC_JIT, M.PTX_JIT, M.CUDA_GRAPHS, M.SLOT_BY_SLOT),
    "rocm": (M.HIP_GRAPHS, M.SLOT_BY_SLOT),
    "xpu": (M.LEVEL_ZERO, M.SLOT_BY_SLOT),
    "metal": (M.MLX, M.METAL, M.SLOT_BY_SLOT),
    "cpu": (M.OPENVINO, M.ONNXRUNTIME, M.ONEDNN, M.MLIR_CPU_JIT, M.ACL, M.ARM_HYBRID, M.NUMPY_REPLAY, M.SLOT_BY_SLOT),
}

# Platforms AUTO tries, most capable first; "cpu" is always last and always there.
PLATFORM_ORDER: tuple[str, ...] = ("cuda", "rocm", "xpu", "metal", "cpu")

# Modes that need a GPU; asked for on a machine without one they are remapped.
GPU_MODES = frozenset({M.CUDA_GRAPHS, M.TRITON, M.NVRTC_JIT, M.PTX_JIT, M.HIP_GRAPHS, M.LEVEL_ZERO})


def provider_hint(mode: GraphExecutionMode) -> str:
    """How to get a backend for ``mode``: the distribution that provides it, or that none does yet."""
    dist = PROVIDERS.get(mode)
    if dist is None:
        return (
            f"no distribution of this repository provides {mode.name} yet; a backend of your own can "
            "(`dsp plugin new NAME`, docs/writing-a-backend.md)"
        )
    return f"install {dist} (in a DSP checkout: `make dist`, then `pip install --find-links dist {dist}`)"
