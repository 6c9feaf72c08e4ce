// PTX_JIT's hand-written kernels: LayerNormalization and Softmax over the last axis, one
// thread block per row, fp32 accumulation (as the reference: stash type float32), the result
// in the input's dtype. Compiled offline by NVRTC after codegen.DEVICE_PRELUDE (the half
// conversions and dsp_block_reduce) into rowwise.ptx (scripts/build_ptx.py); PTX_JIT loads
// that PTX with cuModuleLoadData, so it needs no NVRTC at run time.

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(unsigned short v) { return dsp_h2f(v); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(unsigned short* p, float v) { *p = dsp_f2h(v); }

template <typename T>
__device__ void layer_norm(const T* x, const T* scale, const T* bias, T* y, int n, float eps, int has_bias) {
    __shared__ float shared[32];
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    float sum = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += to_f(xr[i]);
    const float mean = dsp_block_reduce(sum, shared, 0) / n;
    float sq = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float d = to_f(xr[i]) - mean; sq += d * d; }
    const float inv_std = 1.f / sqrtf(dsp_block_reduce(sq, shared, 0) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = (to_f(xr[i]) - mean) * inv_std * to_f(scale[i]);
        if (has_bias) v += to_f(bias[i]);
        put(yr + i, v);
    }
}

template <typename T>
__device__ void softmax(const T* x, T* y, int n) {
    __shared__ float shared[32];
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    float m = -DSP_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, to_f(xr[i]));
    m = dsp_block_reduce(m, shared, 1);
    float sum = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += expf(to_f(xr[i]) - m);
    sum = dsp_block_reduce(sum, shared, 0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) put(yr + i, expf(to_f(xr[i]) - m) / sum);
}

extern "C" __global__ void ln_float32(const float* x, const float* s, const float* b, float* y,
                                      int n, float eps, int hb) { layer_norm<float>(x, s, b, y, n, eps, hb); }
extern "C" __global__ void ln_float16(const unsigned short* x, const unsigned short* s, const unsigned short* b,
                                      unsigned short* y, int n, float eps, int hb) {
    layer_norm<unsigned short>(x, s, b, y, n, eps, hb);
}
extern "C" __global__ void softmax_float32(const float* x, float* y, int n) { softmax<float>(x, y, n); }
extern "C" __global__ void softmax_float16(const unsigned short* x, unsigned short* y, int n) {
    softmax<unsigned short>(x, y, n);
}
