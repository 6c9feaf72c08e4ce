"""dsp-triton: DSP's TRITON backend (fusion groups as generated Triton kernels inside CUDA graphs)."""

__version__ = "0.1.0"
