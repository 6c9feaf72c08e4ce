#!/usr/bin/env bash
# On the GPU machine: install DSP (scripts/gpu_setup.sh), run the GPU tests, the
# conformance kit for CUDA_GRAPHS, TRITON, NVRTC_JIT and PTX_JIT, then the step benchmark. Logs and JSON go to $OUT.
# STAGES (default "tests kit bench") picks what runs; BENCH_ARGS is passed to the benchmark.
#   gputests: every GPU test (tests/gpu); tritoncpu: dsp-triton's CPU tests, whose generated
#   kernels run under Triton's interpreter where triton and torch are installed (the image);
#   nvrtc: dsp-nvrtc's GPU tests (NVRTC_JIT and PTX_JIT; kernel counts in $OUT/nvrtc_kernel_counts.json);
#   nodes: ONNX's node cases with --mode triton (NODE_MODE): captured / partly / eager with reason / wrong
#   per case, over 14 processes, JSON under $OUT;
#   decode: the decode race (benchmarks/decode_gpu.py,
#   JSON under $OUT/decode, exports in /tmp/dsp_onnx; DECODE_ARGS passed on);
#   products: dsp-nvrtc's product kernels by lanes and columns against dsp-triton's and cuBLAS
#   (benchmarks/products_nvrtc.py, $OUT/products_nvrtc.json; PRODUCTS_ARGS passed on);
#   cudnn: the cuDNN convolution / pooling tests, the node cases given device paths, dsp-triton's conv groups
#   and flash attention (about 5 minutes);
#   models: the non-decoder models against torch (benchmarks/models_gpu.py, $OUT/models_gpu.json;
#   MODELS_ARGS passed on, e.g. "--models resnet50,minilm --dtypes fp16 --batches 1,8 --no-compile");
#   graphnodes: ONNX's node cases with --mode cuda_graphs (captured / partly / eager with reason /
#   wrong per case, $OUT/node_suite_cuda_graphs.json; about 35 s with 14 jobs).
# The issue-15 run (about 5 minutes on a fresh H200): STAGES="cudnn graphnodes models"
#   MODELS_ARGS="--models resnet50,vit-s,minilm,bert-128 --dtypes fp16,fp32 --batches 1,8 --no-compile --steps 50"
# What issue 15 still needs measured against torch.compile: STAGES="compilecells" (about 8 minutes:
#   ViT-S fp16 batch 8 and fp32, MiniLM / BERT-128 / BERT-512 fp32 batch 8, BERT-512 fp32 batch 1;
#   JSON and logs as $OUT/compile_cells_*.json)
# The LLM decode run: STAGES="gputests decode" bash scripts/gpu_run.sh
# dsp-nvrtc against dsp-triton (about 7 minutes on a fresh H200): STAGES="nvrtc products decode"
#   NVRTC_TIMEOUT=120 DECODE_TIMEOUT=360 DECODE_ARGS="--models llama-1b,gpt2-124m --modes triton,nvrtc_jit --peers dsp_block
#   --repeats 1" bash scripts/gpu_run.sh
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
    kit) for b in cuda_graphs triton nvrtc_jit ptx_jit; do
           timeout 200 python3 -m pytest -q --pyargs dsp_core.testing.conformance --dsp-backend $b -p no:cacheprovider 2>&1 | tee "$OUT/conformance_$b.log" | tail -5
         done ;;
    nvrtc) timeout ${NVRTC_TIMEOUT:-500} python3 -m pytest -q tests/gpu/test_nvrtc_gpu.py tests/gpu/test_ptx_rowwise_gpu.py -p no:cacheprovider -rs 2>&1 | tee "$OUT/nvrtc_gpu.log" | tail -40 ;;
    tritoncpu) timeout 300 python3 -m pytest -q tests/test_triton_cpu.py -p no:cacheprovider 2>&1 | tee "$OUT/triton_cpu.log" | tail -5 ;;
    nodes) timeout ${NODES_TIMEOUT:-400} python3 scripts/node_suite.py --mode ${NODE_MODE:-triton} --jobs 14 --json "$OUT/node_suite_${NODE_MODE:-triton}.json" ${NODE_ARGS:-} 2>&1 | tee "$OUT/node_suite.log" | tail -15 ;;
    products) timeout ${PRODUCTS_TIMEOUT:-120} python3 benchmarks/products_nvrtc.py --out "$OUT/products_nvrtc.json" ${PRODUCTS_ARGS:-} 2>&1 | grep -v -i warn | tee "$OUT/products_nvrtc.log" | tail -16 ;;
    cudnn) timeout ${CUDNN_TIMEOUT:-330} python3 -m pytest -q tests/gpu/test_cudnn_gpu.py tests/gpu/test_device_paths_gpu.py tests/gpu/test_triton_conv_gpu.py tests/gpu/test_triton_attention_gpu.py -p no:cacheprovider -rs 2>&1 | tee "$OUT/cudnn_gpu.log" | tail -15 ;;
    models) timeout ${MODELS_TIMEOUT:-400} python3 benchmarks/models_gpu.py --out "$OUT/models_gpu.json" ${MODELS_ARGS:-} 2>&1 | tee "$OUT/models_gpu.log" | grep -E "^(model|---|bert|minilm|resnet|vit)" ;;
    compilecells)
      for cell in "vit-s:fp16:8" "vit-s:fp32:1,8" "minilm,bert-128:fp32:8" "bert-512:fp32:1,8"; do
        IFS=: read -r m d b <<< "$cell"
        timeout ${CELL_TIMEOUT:-200} python3 benchmarks/models_gpu.py --models "$m" --dtypes "$d" --batches "$b" --steps 30 \
          --out "$OUT/compile_cells_${m//,/_}_${d}_${b//,/_}.json" 2>&1 | tee "$OUT/compile_cells_${m//,/_}_${d}.log" \
          | grep -E "^(model|bert|minilm|vit)"
      done ;;
    graphnodes) timeout ${GRAPHNODES_TIMEOUT:-200} python3 scripts/node_suite.py --mode cuda_graphs --jobs 14 --json "$OUT/node_suite_cuda_graphs.json" 2>&1 | tee "$OUT/node_suite_cuda_graphs.log" | tail -12 ;;
    bench) timeout 400 python3 benchmarks/step_gpu.py --out "$OUT/step_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^\s" | tail -30 ;;
  esac
done
