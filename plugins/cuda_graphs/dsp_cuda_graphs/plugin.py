"""The plugin module named by the entry point: the CUDA_GRAPHS backend, its contract and profile."""

from __future__ import annotations

from dsp_core import config, hookimpl
from dsp_core.backends.base import (
    Availability,
    Backend,
    CaptureProfile,
    CompiledSegment,
    Decline,
    DeclineReason,
    ModeContract,
    SlotView,
)
from dsp_core.backends.modes import GraphExecutionMode
from dsp_core.ops.registry import Trait
from dsp_core.plan.plan import Plan, Segment
from dsp_cuda_graphs import device

# What CuPy computes with (bfloat16 and the sub-byte types exist in numpy only, via ml_dtypes).
DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}
)

# Ops whose reference kernels read *data* values on the host (a device-to-host copy that a
# capture cannot hold) even when shapes are fixed; host-sync ops (dynamic output size),
# control flow and random ops are gaps already, by their traits.
HOST_READING_OPS = frozenset(
    {"RoiAlign", "MaxRoiPool", "NonMaxSuppression", "ArrayFeatureExtractor", "MaxUnpool", "Unique", "Compress"}
)


# Scatters whose reduction=mul combines duplicates with ufunc.at: CuPy has add/max/min.at only.
MULTIPLY_AT_OPS = frozenset({"ScatterElements", "ScatterND", "Scatter"})


def _contract() -> ModeContract:
    tf32 = bool(config.get("cublas_tf32"))  # read once, when the plugin loads
    return ModeContract(
        deterministic=not tf32,  # cuBLAS with fixed algorithms and no atomics: bit-equal reruns
        needs_stable_addresses=True,  # a graph bakes every buffer address in
        can_update_in_place=True,  # host-fed inputs move freely; a moved device input means recapture
        tf32=tf32,
        dtypes=DTYPES,
        tolerance=1e-2 if tf32 else 2e-3,
    )


class CudaGraphsBackend(Backend):
    """Reference kernels on CuPy, matmuls through cuBLAS, islands captured into CUDA graphs."""

    name = "cuda_graphs"
    mode = GraphExecutionMode.CUDA_GRAPHS
    platform = "cuda"
    captures = True
    contract = _contract()
    profile = CaptureProfile(max_island_nodes=None, excluded_ops=HOST_READING_OPS)

    def _availability_probe(self) -> Availability:
        reason = device.probe()
        return Availability.yes() if reason is None else Availability.no(reason)

    def _runs_excluded_ops_eagerly(self) -> bool:
        return True  # excluded ops are gaps on this backend, not declined

    def _supports(self, slot: SlotView) -> Decline | None:
        if slot.traits & Trait.CONTROL_FLOW:
            return Decline(DeclineReason.CONTROL_FLOW, f"{slot.op} runs subgraphs: left to the CPU reference")
        if slot.op in MULTIPLY_AT_OPS and slot.attrs.get("reduction") == "mul":
            return Decline(
                DeclineReason.UNSUPPORTED_ATTRIBUTE,
                f"{slot.op} reduction=mul needs multiply.at, which CuPy does not have: left to the CPU reference",
            )
        return None

    def _compile(self, plan: Plan, segment: Segment) -> CompiledSegment:
        from dsp_cuda_graphs.segment import CudaGraphSegment

        return CudaGraphSegment(self, plan, segment, self.contract.tf32)

    # -- staging hook (dsp_core.runtime.staging): fed host arrays go to stable device buffers --
    def stage_buffer(self, value: object) -> object | None:
        """A device buffer for a fed array that this backend's units read."""
        cp = device.cupy_module()
        return cp.empty(value.shape, dtype=value.dtype)  # type: ignore[attr-defined]

    def stage_into(self, buffer: object, value: object) -> None:
        """Copy a fed array (host or device) into its device buffer, on the legacy stream (fenced later)."""
        import numpy as np

        from dsp_cuda_graphs.segment import host_contiguous

        if isinstance(value, np.ndarray):
            buffer.set(host_contiguous(value))  # type: ignore[attr-defined]
        elif value.flags.c_contiguous and value.dtype == buffer.dtype and value.shape == buffer.shape:  # type: ignore[attr-defined]
            # one device-to-device copy on the current stream (an elementwise kernel costs more host time)
            buffer.data.copy_from_device_async(value.data, value.nbytes)  # type: ignore[attr-defined]
        else:
            buffer[...] = value  # type: ignore[index]


@hookimpl
def dsp_register_backends() -> list[Backend]:
    """dsp-cuda-graphs' one backend."""
    return [CudaGraphsBackend()]
