"""dsp-cuda-graphs: the CUDA_GRAPHS backend (CuPy buffers, stream capture, graph replay).

Registered through the ``dsp.backends`` entry point. Without CuPy or a CUDA device it
still installs and lists as unavailable, with the reason.
"""

from dsp_cuda_graphs.plugin import CudaGraphsBackend, dsp_register_backends

__all__ = ["CudaGraphsBackend", "dsp_register_backends"]
