"""dsp-openvino: DSP's OPENVINO backend (a segment = one compiled OpenVINO model on the CPU)."""
