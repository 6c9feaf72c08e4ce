"""dsp-onnxruntime: DSP's ONNXRUNTIME backend (a segment = one InferenceSession with IOBinding)."""
