// Causal prefill attention in CUDA (FlashAttention's tiling): the same computation as
// reference.py's flash_attention_ref and triton.py.
//
// What: a prompt of T tokens attends to itself causally (query i sees keys 0..i). Layouts:
//
//     q, out   [T, H, D]     contiguous
//     k, v     [T, Hkv, D]   contiguous; query head h reads KV head h / (H / Hkv)  (GQA)
//
// What it teaches, compared with the Triton version: the tiles a Triton program holds as whole
// tensors are spelled out here as shared memory and threads. One thread block per (query tile
// of BLOCK_Q = 16 queries, query head), 128 threads. Each query row of the tile belongs to a
// group of THREADS_PER_ROW = 8 neighbouring lanes of one warp, so a row's reductions are three
// shuffles and never need a block-wide barrier:
//
//     thread tid:  row r = tid / 8 (query q_start + r),  sub = tid % 8
//     owns:        scores of keys sub, sub + 8 in each key tile;  output dims sub, sub + 8, ...
//
//     load Q tile (times scale) into shared memory                        __syncthreads()
//     for each key tile j up to the diagonal (BLOCK_K = 16 keys):
//         load K, V tile [16, D] into shared memory                       __syncthreads() x 2
//         1. scores   s = Q[r] . K[key] from shared memory, -inf where key > query
//         2. softmax  m_new = max(m, row max) by 8-lane shuffles; p = exp(s - m_new) into shared
//                     memory; l = l * alpha + row sum, alpha = exp(m - m_new)   __syncwarp()
//         3. P @ V    acc[d] = acc[d] * alpha + sum_t p[t] * V[t, d]   (fp32 registers)
//     out[q, h, d] = acc[d] / l
//
// Tiles wholly above the diagonal are never loaded: query tile i reads key tiles 0..i only.
// Shared-memory rows are padded by one float (stride D + 1), so the 8 lanes of a row group,
// reading 8 different keys at the same d, hit 8 different banks instead of one.
//
// Everything accumulates in fp32 whatever the storage type (float, half, bfloat16 through
// templates). Inputs are checked by the Python launcher (cuda.py) before we get here.
//
// This file compiles on its own with nvcc (no torch headers), so tests can ask ptxas for the
// register use:  nvcc -arch=sm_90 -cubin -Xptxas -v flash_prefill.cu
// The PyTorch binding at the bottom is compiled only with -DSERVELAB_TORCH_EXTENSION.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace servelab_flash {

constexpr int BLOCK_Q = 16;      // queries per thread block
constexpr int BLOCK_K = 16;      // keys per shared-memory tile
constexpr int NUM_THREADS = 128;  // 4 warps
constexpr int THREADS_PER_ROW = NUM_THREADS / BLOCK_Q;       // 8 lanes share one query row
constexpr int KEYS_PER_THREAD = BLOCK_K / THREADS_PER_ROW;    // 2 scores per thread per tile
constexpr int MAX_HEAD_DIM = 256;                             // covers every common model (64..256)
constexpr int MAX_DIMS_PER_THREAD = MAX_HEAD_DIM / THREADS_PER_ROW;  // 32 fp32 accumulators
constexpr int DEFAULT_SMEM_BYTES = 48 * 1024;  // dynamic shared memory a launch gets without opting in
constexpr unsigned FULL_WARP = 0xffffffffu;
static_assert(NUM_THREADS % BLOCK_Q == 0 && BLOCK_K % THREADS_PER_ROW == 0, "tiles must split evenly");
static_assert(32 % THREADS_PER_ROW == 0, "a row's lanes must sit in one warp");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Reductions over the 8 lanes of one row group: xor offsets 4, 2, 1 never leave the group.
__device__ __forceinline__ float row_max(float x) {
  for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(FULL_WARP, x, offset));
  return x;
}

__device__ __forceinline__ float row_sum(float x) {
  for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(FULL_WARP, x, offset);
  return x;
}

// Rows [first_row, first_row + rows) of a [T, heads, D] tensor at one head, into shared memory
// as fp32 [rows][D + 1], times `mul`; rows past num_tokens become zeros.
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* __restrict__ src, int first_row, int rows,
                                          int num_tokens, int num_heads, int head, int head_dim, float mul) {
  const int row_stride = head_dim + 1;
  for (int i = threadIdx.x; i < rows * head_dim; i += NUM_THREADS) {
    const int r = i / head_dim, d = i % head_dim, token = first_row + r;
    const float x = token < num_tokens ? to_float(src[((int64_t)token * num_heads + head) * head_dim + d]) : 0.f;
    dst[r * row_stride + d] = x * mul;
  }
}

template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) flash_prefill_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
    float scale, int num_tokens, int num_heads, int num_kv_heads, int head_dim) {
  extern __shared__ float smem[];
  const int row_stride = head_dim + 1;               // one float of padding per row: no bank conflicts
  float* s_q = smem;                                 // [BLOCK_Q][D + 1]  the query tile, times scale
  float* s_k = s_q + BLOCK_Q * row_stride;           // [BLOCK_K][D + 1]  the current key tile
  float* s_v = s_k + BLOCK_K * row_stride;           // [BLOCK_K][D + 1]  the current value tile
  float* s_p = s_v + BLOCK_K * row_stride;           // [BLOCK_Q][BLOCK_K + 1]  probabilities

  const int q_start = blockIdx.x * BLOCK_Q, head = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int r = threadIdx.x / THREADS_PER_ROW, sub = threadIdx.x % THREADS_PER_ROW;
  const int query = q_start + r;  // may be >= num_tokens in the last tile: computed, never stored
  const int last_query = min(q_start + BLOCK_Q, num_tokens) - 1;
  const int num_key_tiles = last_query / BLOCK_K + 1;  // up to the diagonal; the rest is skipped

  load_tile(s_q, q, q_start, BLOCK_Q, num_tokens, num_heads, head, head_dim, scale);

  float m = -INFINITY, l = 0.f;  // this row's running max and sum (same value in its 8 lanes)
  float acc[MAX_DIMS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) acc[i] = 0.f;

  for (int j = 0; j < num_key_tiles; ++j) {
    const int k_start = j * BLOCK_K;
    __syncthreads();  // everyone is done with the previous K/V tile (and s_q is written, at j = 0)
    load_tile(s_k, k, k_start, BLOCK_K, num_tokens, num_kv_heads, kv_head, head_dim, 1.f);
    load_tile(s_v, v, k_start, BLOCK_K, num_tokens, num_kv_heads, kv_head, head_dim, 1.f);
    __syncthreads();

    float s[KEYS_PER_THREAD], tile_max = -INFINITY;  // 1. scores of keys sub, sub + 8
#pragma unroll
    for (int c = 0; c < KEYS_PER_THREAD; ++c) {
      const int col = sub + c * THREADS_PER_ROW, key = k_start + col;
      float dot = 0.f;
      for (int d = 0; d < head_dim; ++d) dot += s_q[r * row_stride + d] * s_k[col * row_stride + d];
      s[c] = (key <= query && key < num_tokens) ? dot : -INFINITY;  // causal mask, and the ragged end
      tile_max = fmaxf(tile_max, s[c]);
    }

    const float m_new = fmaxf(m, row_max(tile_max));  // 2. online softmax; finite: key 0 is in tile 0
    const float alpha = expf(m - m_new);              // 0 on the first tile (m = -inf)
    float tile_sum = 0.f;
#pragma unroll
    for (int c = 0; c < KEYS_PER_THREAD; ++c) {
      const float p = expf(s[c] - m_new);
      s_p[r * (BLOCK_K + 1) + sub + c * THREADS_PER_ROW] = p;
      tile_sum += p;
    }
    l = l * alpha + row_sum(tile_sum);
    m = m_new;
    __syncwarp();  // the row's 8 lanes (one warp) see each other's probabilities

#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {  // 3. P @ V, dims d = sub + 8 i
      const int d = sub + i * THREADS_PER_ROW;
      if (d < head_dim) {
        float pv = 0.f;
#pragma unroll
        for (int t = 0; t < BLOCK_K; ++t) pv += s_p[r * (BLOCK_K + 1) + t] * s_v[t * row_stride + d];
        acc[i] = acc[i] * alpha + pv;
      }
    }
    // s_p is rewritten only after the next iteration's two barriers, so no barrier here.
  }

  if (query >= num_tokens) return;
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
    const int d = sub + i * THREADS_PER_ROW;
    if (d < head_dim) out[((int64_t)query * num_heads + head) * head_dim + d] = from_float<T>(acc[i] / l);
  }
}

// Host-side launch: grid (query tiles, H), 128 threads, shared memory for Q, K, V and P tiles.
template <typename T>
cudaError_t launch_flash_prefill(const T* q, const T* k, const T* v, T* out, float scale, int num_tokens,
                                 int num_heads, int num_kv_heads, int head_dim, cudaStream_t stream) {
  if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const size_t smem_bytes =
      ((size_t)(BLOCK_Q + 2 * BLOCK_K) * (head_dim + 1) + BLOCK_Q * (BLOCK_K + 1)) * sizeof(float);
  if (smem_bytes > DEFAULT_SMEM_BYTES) {  // D > 250: ask for more than the default 48 KiB
    const cudaError_t err = cudaFuncSetAttribute(flash_prefill_kernel<T>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((num_tokens + BLOCK_Q - 1) / BLOCK_Q, num_heads);
  flash_prefill_kernel<T><<<grid, NUM_THREADS, smem_bytes, stream>>>(q, k, v, out, scale, num_tokens, num_heads,
                                                                     num_kv_heads, head_dim);
  return cudaGetLastError();
}

// Explicit instantiations: one kernel per storage type ends up in the cubin.
#define SERVELAB_INSTANTIATE(T)                                                                        \
  template cudaError_t launch_flash_prefill<T>(const T*, const T*, const T*, T*, float, int, int, int, int, \
                                               cudaStream_t);
SERVELAB_INSTANTIATE(float)
SERVELAB_INSTANTIATE(__half)
SERVELAB_INSTANTIATE(__nv_bfloat16)
#undef SERVELAB_INSTANTIATE

}  // namespace servelab_flash

#ifdef SERVELAB_TORCH_EXTENSION
// ---- PyTorch binding (built by kernels/flash_prefill/cuda.py) --------------------------------
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

template <typename T>
static cudaError_t run_flash_prefill(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     torch::Tensor& out, double scale) {
  return servelab_flash::launch_flash_prefill<T>(
      static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
      static_cast<T*>(out.data_ptr()), static_cast<float>(scale), q.size(0), q.size(1), k.size(1), q.size(2),
      c10::cuda::getCurrentCUDAStream());
}

// The Python launcher has already run check_flash_inputs; here we only guard the layout.
torch::Tensor flash_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.is_cuda() && q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "q, k, v must be contiguous CUDA tensors");
  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor out = torch::empty_like(q);
  cudaError_t err;
  switch (q.scalar_type()) {
    case at::kFloat: err = run_flash_prefill<float>(q, k, v, out, scale); break;
    case at::kHalf: err = run_flash_prefill<__half>(q, k, v, out, scale); break;
    case at::kBFloat16: err = run_flash_prefill<__nv_bfloat16>(q, k, v, out, scale); break;
    default: TORCH_CHECK(false, "q: dtype must be float32, float16 or bfloat16");
  }
  TORCH_CHECK(err == cudaSuccess, "flash_prefill launch failed: ", cudaGetErrorString(err));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flash_prefill", &flash_prefill, "causal flash prefill attention (q, k, v, scale)");
}
#endif  // SERVELAB_TORCH_EXTENSION
