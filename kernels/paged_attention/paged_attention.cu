// Paged decode attention in CUDA: the same computation as reference.py and triton.py.
//
// What: one new query token per sequence attends to that sequence's cached K/V, which lives in
// physical blocks of a pool, found through the sequence's block table (vLLM's PagedAttention,
// Kwon et al., SOSP 2023). Layouts, as everywhere in servelab:
//
//     q, out          [B, H, D]             contiguous
//     k_pool, v_pool  [NB, BS, Hkv, D]      D contiguous; strides passed in
//     block_tables    [B, max_blocks] int32 contiguous; entry j = physical block of tokens
//                                           j*BS .. j*BS+BS-1
//     seq_lens        [B] int32
//     window          sliding window W (0: none): the query reads only positions seq_len - W ..
//                     seq_len - 1; table entries of blocks before them are never read (may be -1)
//
// What it teaches, compared with the Triton version: the work a Triton program does with whole
// tiles is spelled out here thread by thread. One thread block per (sequence, query head), 4
// warps. For each KV block of the sequence:
//
//     1. scores   one warp per token: the 32 lanes split D, multiply q.k, and a shuffle
//                 reduction (__shfl_xor_sync) adds the 32 partial sums; lane 0 writes the score
//                 to shared memory.                                       __syncthreads()
//     2. softmax  the online softmax (running max m, running sum l): every warp reduces the
//                 block's max with shuffles (no extra barrier), then threads write
//                 p = exp(s - m_new) to shared memory.                    __syncthreads()
//     3. P @ V    each thread owns D / 128 output dims and accumulates sum_t p[t] * V[t, d]
//                 in fp32 registers, after rescaling by alpha = exp(m_old - m_new).
//
// Everything accumulates in fp32 whatever the storage type (float, half, bfloat16 through
// templates). Inputs are checked by the Python launcher (cuda.py) before we get here.
//
// This file compiles on its own with nvcc (no torch headers), so tests can ask ptxas for the
// register and shared-memory use:  nvcc -arch=sm_90 -cubin -Xptxas -v paged_attention.cu
// The PyTorch binding at the bottom is compiled only with -DSERVELAB_TORCH_EXTENSION.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace servelab {

constexpr int WARP_SIZE = 32;
constexpr int NUM_THREADS = 128;  // 4 warps: enough tokens in flight per block, low register pressure
constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
constexpr int MAX_DIMS_PER_THREAD = 4;  // output dims per thread, so D <= 128 * 4 = 512
constexpr int MAX_HEAD_DIM = NUM_THREADS * MAX_DIMS_PER_THREAD;
constexpr unsigned FULL_WARP = 0xffffffffu;  // all 32 lanes take part in the shuffle

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Butterfly reductions: after log2(32) = 5 exchanges every lane holds the warp's result.
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(FULL_WARP, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(FULL_WARP, x, offset));
  return x;
}

template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) paged_decode_kernel(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens, T* __restrict__ out,
    float scale, int window, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    int64_t stride_kn, int64_t stride_ks, int64_t stride_kh,
    int64_t stride_vn, int64_t stride_vs, int64_t stride_vh) {
  extern __shared__ float smem[];
  float* s_q = smem;                       // [D]   the query, converted to fp32 once
  float* s_logits = s_q + head_dim;        // [BS]  scores of the current block
  float* s_probs = s_logits + block_size;  // [BS]  exp(score - running max)

  const int head = blockIdx.x, seq = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);  // GQA: a group of query heads per KV head
  const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  const int seq_len = seq_lens[seq];
  const int num_blocks = (seq_len + block_size - 1) / block_size;
  const int first = window > 0 ? max(0, seq_len - window) : 0;  // first position the query reads
  const int64_t row = (int64_t)seq * num_heads + head;

  for (int d = tid; d < head_dim; d += NUM_THREADS) s_q[d] = to_float(q[row * head_dim + d]);
  __syncthreads();

  float m = -INFINITY, l = 0.f;  // identical in every thread: each computes them from shared memory
  float acc[MAX_DIMS_PER_THREAD] = {0.f, 0.f, 0.f, 0.f};

  for (int j = first / block_size; j < num_blocks; ++j) {  // blocks before the window: skipped
    const int64_t phys = block_tables[(int64_t)seq * max_blocks + j];
    const int n_valid = min(block_size, seq_len - j * block_size);  // tokens in this block
    const T* k_block = k_pool + phys * stride_kn + kv_head * stride_kh;
    const T* v_block = v_pool + phys * stride_vn + kv_head * stride_vh;

    for (int t = warp; t < n_valid; t += NUM_WARPS) {  // 1. scores, one warp per token
      float dot = 0.f;
      for (int d = lane; d < head_dim; d += WARP_SIZE) dot += s_q[d] * to_float(k_block[t * stride_ks + d]);
      dot = warp_sum(dot);
      if (lane == 0) s_logits[t] = j * block_size + t < first ? -INFINITY : dot * scale;  // before the window
    }
    __syncthreads();

    float block_max = -INFINITY;  // 2. online softmax
    for (int t = lane; t < n_valid; t += WARP_SIZE) block_max = fmaxf(block_max, s_logits[t]);
    const float m_new = fmaxf(m, warp_max(block_max));  // finite: every block read has >= 1 visible token
    const float alpha = expf(m - m_new);                 // 0 on the first block (m = -inf)
    for (int t = tid; t < n_valid; t += NUM_THREADS) s_probs[t] = expf(s_logits[t] - m_new);
    __syncthreads();
    float block_sum = 0.f;
    for (int t = lane; t < n_valid; t += WARP_SIZE) block_sum += s_probs[t];
    l = l * alpha + warp_sum(block_sum);
    m = m_new;

#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {  // 3. P @ V, dims d = tid + i * 128
      const int d = tid + i * NUM_THREADS;
      if (d < head_dim) {
        float pv = 0.f;
        for (int t = 0; t < n_valid; ++t) pv += s_probs[t] * to_float(v_block[t * stride_vs + d]);
        acc[i] = acc[i] * alpha + pv;
      }
    }
    // No third barrier: s_logits is rewritten only after everyone passed the barrier above
    // (its last readers came before it), and s_probs only after the next iteration's first one.
  }

#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
    const int d = tid + i * NUM_THREADS;
    if (d < head_dim) out[row * head_dim + d] = from_float<T>(acc[i] / l);
  }
}

// Host-side launch: grid (H, B), 128 threads, shared memory for q, scores and probabilities.
template <typename T>
cudaError_t launch_paged_decode(const T* q, const T* k_pool, const T* v_pool, const int32_t* block_tables,
                                const int32_t* seq_lens, T* out, float scale, int window, int batch, int num_heads,
                                int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                int64_t stride_kn, int64_t stride_ks, int64_t stride_kh, int64_t stride_vn,
                                int64_t stride_vs, int64_t stride_vh, cudaStream_t stream) {
  if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  const dim3 grid(num_heads, batch);
  const size_t smem_bytes = (size_t)(head_dim + 2 * block_size) * sizeof(float);
  paged_decode_kernel<T><<<grid, NUM_THREADS, smem_bytes, stream>>>(
      q, k_pool, v_pool, block_tables, seq_lens, out, scale, window, num_heads, num_kv_heads, head_dim, block_size,
      max_blocks, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh);
  return cudaGetLastError();
}

// Explicit instantiations: one kernel per storage type ends up in the cubin.
#define SERVELAB_INSTANTIATE(T)                                                                         \
  template cudaError_t launch_paged_decode<T>(const T*, const T*, const T*, const int32_t*, const int32_t*, \
                                              T*, float, int, int, int, int, int, int, int, int64_t, int64_t, \
                                              int64_t, int64_t, int64_t, int64_t, cudaStream_t);
SERVELAB_INSTANTIATE(float)
SERVELAB_INSTANTIATE(__half)
SERVELAB_INSTANTIATE(__nv_bfloat16)
#undef SERVELAB_INSTANTIATE

}  // namespace servelab

#ifdef SERVELAB_TORCH_EXTENSION
// ---- PyTorch binding (built by kernels/paged_attention/cuda.py) ------------------------------
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

template <typename T>
static cudaError_t run_paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool,
                                    const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                                    const torch::Tensor& seq_lens, torch::Tensor& out, double scale,
                                    int64_t window) {
  return servelab::launch_paged_decode<T>(
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k_pool.data_ptr()),
      static_cast<const T*>(v_pool.data_ptr()), block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
      static_cast<T*>(out.data_ptr()), static_cast<float>(scale), static_cast<int>(window), q.size(0), q.size(1),
      k_pool.size(2),
      q.size(2), k_pool.size(1), block_tables.size(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
      v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), c10::cuda::getCurrentCUDAStream());
}

// The Python launcher has already run check_paged_inputs; here we only guard the layout.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.is_cuda() && q.is_contiguous(), "q must be a contiguous CUDA tensor");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables/lengths must be contiguous");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, "pools must be contiguous in D");
  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor out = torch::empty_like(q);
  cudaError_t err;
  switch (q.scalar_type()) {
    case at::kFloat: err = run_paged_decode<float>(q, k_pool, v_pool, block_tables, seq_lens, out, scale, window); break;
    case at::kHalf: err = run_paged_decode<__half>(q, k_pool, v_pool, block_tables, seq_lens, out, scale, window); break;
    case at::kBFloat16:
      err = run_paged_decode<__nv_bfloat16>(q, k_pool, v_pool, block_tables, seq_lens, out, scale, window);
      break;
    default: TORCH_CHECK(false, "q: dtype must be float32, float16 or bfloat16");
  }
  TORCH_CHECK(err == cudaSuccess, "paged_decode launch failed: ", cudaGetErrorString(err));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (q, k_pool, v_pool, block_tables, seq_lens, scale, window)");
}
#endif  // SERVELAB_TORCH_EXTENSION
