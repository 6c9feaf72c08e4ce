#!/usr/bin/env bash
# On the GPU machine: install DSP (scripts/gpu_setup.sh), run the GPU tests, the
# conformance kit for CUDA_GRAPHS, then the step benchmark. Logs and JSON go to $OUT.
# STAGES (default "tests kit bench") picks what runs; BENCH_ARGS is passed to the benchmark.
#   gputests: every GPU test (tests/gpu); decode: the decode race (benchmarks/decode_gpu.py,
#   JSON under $OUT/decode, exports in /tmp/dsp_onnx; DECODE_ARGS passed on).
# The LLM decode run: STAGES="gputests decode" bash scripts/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tests kit bench"}
bash scripts/gpu_setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
python3 -m dsp_core.cli backends list 2>&1 | grep -i cuda
for stage in $STAGES; do
  case $stage in
    tests) timeout 240 python3 -m pytest -q -x tests/gpu/test_cuda_graphs.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    alltests) timeout 300 make gpu-test GPU_PYTHON=python3 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    gputests) timeout ${GPUTESTS_TIMEOUT:-200} python3 -m pytest -q tests/gpu -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    decode) timeout ${DECODE_TIMEOUT:-330} python3 benchmarks/decode_gpu.py --out "$OUT/decode" --onnx-dir /tmp/dsp_onnx --timeout 240 ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | grep -v "^\s" | tail -40 ;;
    kit) timeout 200 python3 -m pytest -q --pyargs dsp_core.testing.conformance --dsp-backend cuda_graphs -p no:cacheprovider 2>&1 | tee "$OUT/conformance.log" | tail -25 ;;
    bench) timeout 400 python3 benchmarks/step_gpu.py --out "$OUT/step_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^\s" | tail -30 ;;
  esac
done
