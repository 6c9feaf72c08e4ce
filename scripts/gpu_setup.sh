#!/usr/bin/env bash
# Install DSP into the GPU image's own Python, which has no network: stevedore comes from
# a carried wheel (.whl/), everything else the image already has. Then `make gpu-test
# GPU_PYTHON=python3` runs the GPU tests. dsp-onnxruntime's CUDA backend needs onnxruntime-gpu,
# which the image lacks (its onnxruntime is the CPU build): unpack an onnxruntime-gpu wheel of
# the image's Python and CUDA into a folder and put that folder first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import stevedore" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps .whl/stevedore-*.whl
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cpu_ref -e plugins/cuda_graphs -e plugins/triton -e plugins/nvrtc -e plugins/onnxruntime -e plugins/openvino -e tests/dists/dsp_test_backends
$PY -c "import dsp_core, dsp_cpu_ref; print('dsp-core', dsp_core.__version__, 'installed')"
