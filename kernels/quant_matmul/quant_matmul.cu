// Fused dequantize-GEMV for int8 and int4 weights in CUDA: the same computation as reference.py
// and triton.py, y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, k / G]) * s[n, k / G].
//
// Layouts (as in reference.py):
//     x        [M, K]        float / half / bfloat16, contiguous
//     qweight  [N, K] int8   (BITS 8)  or  [N, K / 2] uint8, even k in the low nibble (BITS 4)
//     scales   [N, K / G] float32 (row stride stride_sn, group stride stride_sg; both 0 per-tensor)
//     zeros    like scales (BITS 4 only; int8 is symmetric)
//     y        [M, N]        same type as x
//
// What it teaches, beside the Triton version: a GEMV reads each weight byte exactly once and does
// two flops with it, so all that matters is reading memory at full speed. One WARP per output row:
// its 32 lanes read 32 consecutive bytes of the row at a time (one coalesced 32-byte transaction),
// turn them into floats in registers (int4: two nibbles per byte), multiply by x and the group's
// scale, and finally add their 32 partial sums with shuffles (__shfl_xor_sync). The fp32 weight
// row never exists in memory: that is the whole point (see triton.py for the byte count).
//
// Compiles on its own with nvcc (no torch headers), so the tests can ask ptxas for registers:
//     nvcc -arch=sm_90 -cubin -Xptxas -v quant_matmul.cu
// The PyTorch binding at the bottom is compiled only with -DSERVELAB_TORCH_EXTENSION.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace servelab {

constexpr int WARP_SIZE = 32;
constexpr int NUM_THREADS = 128;  // 4 warps = 4 output rows per thread block
constexpr int ROWS_PER_BLOCK = NUM_THREADS / WARP_SIZE;
constexpr unsigned FULL_WARP = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(FULL_WARP, x, offset);
  return x;
}

// grid (ceil(N / ROWS_PER_BLOCK), M): warp w of block b computes y[m, b * ROWS_PER_BLOCK + w].
template <typename T, int BITS>
__global__ void __launch_bounds__(NUM_THREADS) dequant_gemv_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const float* __restrict__ scales,
    const float* __restrict__ zeros, T* __restrict__ y, int N, int K, int group_size,
    int64_t stride_sn, int64_t stride_sg) {
  const int lane = threadIdx.x % WARP_SIZE;
  const int n = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP_SIZE;
  const int m = blockIdx.y;
  if (n >= N) return;  // a whole warp leaves together, so the shuffles below stay full-warp
  const T* x_row = x + (int64_t)m * K;
  const int row_bytes = BITS == 8 ? K : K / 2;
  const uint8_t* q_row = qweight + (int64_t)n * row_bytes;
  const float* s_row = scales + n * stride_sn;

  float acc = 0.f;
  for (int j = lane; j < row_bytes; j += WARP_SIZE) {  // lanes read consecutive bytes: coalesced
    const uint8_t byte = q_row[j];
    if (BITS == 8) {
      const float s = s_row[(j / group_size) * stride_sg];
      acc += static_cast<float>(static_cast<int8_t>(byte)) * s * to_float(x_row[j]);
    } else {
      const int k = 2 * j;  // k and k + 1 share a group: groups hold an even number of inputs
      const int64_t g = (k / group_size) * stride_sg;
      const float s = s_row[g], z = zeros[n * stride_sn + g];
      const float w_even = (static_cast<float>(byte & 0xF) - z) * s;
      const float w_odd = (static_cast<float>(byte >> 4) - z) * s;
      acc += w_even * to_float(x_row[k]) + w_odd * to_float(x_row[k + 1]);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) y[(int64_t)m * N + n] = from_float<T>(acc);
}

template <typename T, int BITS>
cudaError_t launch_dequant_gemv(const T* x, const uint8_t* qweight, const float* scales, const float* zeros,
                                T* y, int M, int N, int K, int group_size, int64_t stride_sn,
                                int64_t stride_sg, cudaStream_t stream) {
  if (group_size < 1 || K % group_size != 0 || (BITS == 4 && group_size % 2 != 0)) return cudaErrorInvalidValue;
  if (M == 0 || N == 0) return cudaSuccess;
  const dim3 grid((N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, M);
  dequant_gemv_kernel<T, BITS><<<grid, NUM_THREADS, 0, stream>>>(x, qweight, scales, zeros, y, N, K,
                                                                  group_size, stride_sn, stride_sg);
  return cudaGetLastError();
}

// Explicit instantiations: 3 activation types x 2 bit widths = 6 kernels in the cubin.
#define SERVELAB_INSTANTIATE(T, BITS)                                                                   \
  template cudaError_t launch_dequant_gemv<T, BITS>(const T*, const uint8_t*, const float*, const float*, \
                                                    T*, int, int, int, int, int64_t, int64_t, cudaStream_t);
SERVELAB_INSTANTIATE(float, 8)
SERVELAB_INSTANTIATE(__half, 8)
SERVELAB_INSTANTIATE(__nv_bfloat16, 8)
SERVELAB_INSTANTIATE(float, 4)
SERVELAB_INSTANTIATE(__half, 4)
SERVELAB_INSTANTIATE(__nv_bfloat16, 4)
#undef SERVELAB_INSTANTIATE

}  // namespace servelab

#ifdef SERVELAB_TORCH_EXTENSION
// ---- PyTorch binding (built by kernels/quant_matmul/cuda.py) ---------------------------------
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

template <typename T, int BITS>
static cudaError_t run(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                       const torch::Tensor& zeros, torch::Tensor& y, int64_t group_size, int64_t stride_sn,
                       int64_t stride_sg) {
  return servelab::launch_dequant_gemv<T, BITS>(
      static_cast<const T*>(x.data_ptr()), static_cast<const uint8_t*>(qweight.data_ptr()),
      scales.data_ptr<float>(), zeros.data_ptr<float>(), static_cast<T*>(y.data_ptr()), x.size(0), y.size(1),
      x.size(1), group_size, stride_sn, stride_sg, c10::cuda::getCurrentCUDAStream());
}

template <int BITS>
static cudaError_t dispatch(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                            const torch::Tensor& zeros, torch::Tensor& y, int64_t g, int64_t sn, int64_t sg) {
  switch (x.scalar_type()) {
    case at::kFloat: return run<float, BITS>(x, qweight, scales, zeros, y, g, sn, sg);
    case at::kHalf: return run<__half, BITS>(x, qweight, scales, zeros, y, g, sn, sg);
    case at::kBFloat16: return run<__nv_bfloat16, BITS>(x, qweight, scales, zeros, y, g, sn, sg);
    default: TORCH_CHECK(false, "x: dtype must be float32, float16 or bfloat16");
  }
}

// The Python launcher has already run check_quantized_weight / check_activations.
torch::Tensor dequant_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                           int64_t n, int64_t bits, int64_t group_size, int64_t stride_sn, int64_t stride_sg) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "x must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(), "weights must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  const cudaError_t err = bits == 8 ? dispatch<8>(x, qweight, scales, zeros, y, group_size, stride_sn, stride_sg)
                                    : dispatch<4>(x, qweight, scales, zeros, y, group_size, stride_sn, stride_sg);
  TORCH_CHECK(err == cudaSuccess, "dequant_gemv launch failed: ", cudaGetErrorString(err));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequant_gemv", &dequant_gemv, "fused dequantize-GEMV (x, qweight, scales, zeros, n, bits, group, strides)");
}
#endif  // SERVELAB_TORCH_EXTENSION
