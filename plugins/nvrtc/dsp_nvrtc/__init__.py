"""dsp-nvrtc: NVRTC_JIT (fusion groups as generated CUDA C, compiled in process by NVRTC) and
PTX_JIT (committed PTX loaded with cuModuleLoadData), both on dsp-cuda-graphs' runtime layer.

Registered through the ``dsp.backends`` entry point. Without CuPy, a CUDA device or NVRTC
it still installs and lists its backends as unavailable, with the reason.
"""

from dsp_nvrtc.plugin import NvrtcBackend, PtxBackend, dsp_register_backends

__all__ = ["NvrtcBackend", "PtxBackend", "dsp_register_backends"]
