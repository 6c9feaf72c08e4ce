"""dsp-cpu-ref: DSP's reference backends (numpy): SLOT_BY_SLOT, EMULATED_REPLAY, NUMPY_REPLAY and SHAPE_INFERENCE_ONLY.

Registered through the ``dsp.backends`` entry point like any third-party backend.
"""

from dsp_cpu_ref.plugin import (
    EmulatedReplayBackend,
    NumpyReplayBackend,
    ShapeInferenceBackend,
    SlotBySlotBackend,
    dsp_register_backends,
)

__all__ = [
    "EmulatedReplayBackend",
    "NumpyReplayBackend",
    "ShapeInferenceBackend",
    "SlotBySlotBackend",
    "dsp_register_backends",
]
