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
// Split-K (flash-decoding, as in triton.py): with few sequences, B * H thread blocks leave most
// of the GPU idle while each walks all of its blocks. The partition kernel runs the same three
// steps on grid (H, B, P), each thread block over its own share of the blocks (counted from the
// first block the query reads), and writes its unnormalized state m, l, acc [D] to fp32 scratch;
// the reduce kernel, grid (H, B), rescales the P states to their common max and divides:
//
//     M = max_p m_p        out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p
//
// A partition with no block to read leaves m = -inf, l = 0 and gets weight 0. Both attention
// kernels run attend_blocks() below: the one-pass kernel is split-K's P = 1 without the scratch.
//
// Everything accumulates in fp32 whatever the storage type (float, half, bfloat16 through
// templates). Inputs are checked by the Python launcher (cuda.py) before we get here; it also
// picks P (split_k.py).
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
constexpr int MAX_GRID_Z = 65535;  // a grid's third axis (split-K's partitions) holds at most this many

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

// The online-softmax state of one query head: m and l are the same in every thread (each computes
// them from shared memory), acc holds this thread's output dims d = tid + i * 128, unnormalized.
struct SoftmaxState {
  float m, l;
  float acc[MAX_DIMS_PER_THREAD];
};

// Steps 1-3 above over blocks j_begin .. j_end - 1 of one sequence (its block table row `table`),
// for the query in s_q. Every thread of the block must call it (it has barriers); with no block to
// read it returns the empty state m = -inf, l = 0, acc = 0.
template <typename T>
__device__ __forceinline__ SoftmaxState attend_blocks(
    const float* s_q, float* s_logits, float* s_probs, const T* __restrict__ k_pool,
    const T* __restrict__ v_pool, const int32_t* __restrict__ table, int kv_head, int seq_len, int first,
    int j_begin, int j_end, float scale, int head_dim, int block_size,
    int64_t stride_kn, int64_t stride_ks, int64_t stride_kh,
    int64_t stride_vn, int64_t stride_vs, int64_t stride_vh) {
  const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  SoftmaxState st = {-INFINITY, 0.f, {0.f, 0.f, 0.f, 0.f}};

  for (int j = j_begin; j < j_end; ++j) {
    const int64_t phys = table[j];
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
    const float m_new = fmaxf(st.m, warp_max(block_max));  // finite: every block read has >= 1 visible token
    const float alpha = expf(st.m - m_new);                // 0 on the first block (m = -inf)
    for (int t = tid; t < n_valid; t += NUM_THREADS) s_probs[t] = expf(s_logits[t] - m_new);
    __syncthreads();
    float block_sum = 0.f;
    for (int t = lane; t < n_valid; t += WARP_SIZE) block_sum += s_probs[t];
    st.l = st.l * alpha + warp_sum(block_sum);
    st.m = m_new;

#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {  // 3. P @ V, dims d = tid + i * 128
      const int d = tid + i * NUM_THREADS;
      if (d < head_dim) {
        float pv = 0.f;
        for (int t = 0; t < n_valid; ++t) pv += s_probs[t] * to_float(v_block[t * stride_vs + d]);
        st.acc[i] = st.acc[i] * alpha + pv;
      }
    }
    // No third barrier: s_logits is rewritten only after everyone passed the barrier above
    // (its last readers came before it), and s_probs only after the next iteration's first one.
  }
  return st;
}

// Both attention kernels start so: the query, converted to fp32, at the front of shared memory.
template <typename T>
__device__ __forceinline__ float* load_query(const T* __restrict__ q, int64_t row, int head_dim, float* smem) {
  for (int d = threadIdx.x; d < head_dim; d += NUM_THREADS) smem[d] = to_float(q[row * head_dim + d]);
  __syncthreads();
  return smem;
}

// One pass: thread block (query head, sequence) walks every block the query reads.
template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) paged_decode_kernel(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens, T* __restrict__ out,
    float scale, int window, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    int64_t stride_kn, int64_t stride_ks, int64_t stride_kh,
    int64_t stride_vn, int64_t stride_vs, int64_t stride_vh) {
  extern __shared__ float smem[];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);  // GQA: a group of query heads per KV head
  const int seq_len = seq_lens[seq];
  const int num_blocks = (seq_len + block_size - 1) / block_size;
  const int first = window > 0 ? max(0, seq_len - window) : 0;  // first position the query reads
  const int64_t row = (int64_t)seq * num_heads + head;
  float* s_q = load_query(q, row, head_dim, smem);  // [D]   the query, converted to fp32 once
  float* s_logits = s_q + head_dim;                 // [BS]  scores of the current block
  float* s_probs = s_logits + block_size;           // [BS]  exp(score - running max)

  // blocks before the window: skipped
  const SoftmaxState st = attend_blocks<T>(
      s_q, s_logits, s_probs, k_pool, v_pool, block_tables + (int64_t)seq * max_blocks, kv_head, seq_len, first,
      first / block_size, num_blocks, scale, head_dim, block_size, stride_kn, stride_ks, stride_kh, stride_vn,
      stride_vs, stride_vh);

#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
    const int d = threadIdx.x + i * NUM_THREADS;
    if (d < head_dim) out[row * head_dim + d] = from_float<T>(st.acc[i] / st.l);
  }
}

// Split-K, step 1: thread block (query head, sequence, partition) attends to the partition's
// blocks, counted from the first block the query reads, and writes its state to fp32 scratch:
// part_max, part_sum [B, H, P] and part_acc [B, H, P, D], unnormalized (no division: the other
// partitions are missing). A partition past the sequence's last block writes -inf, 0, 0.
template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) paged_decode_partition_kernel(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens, float* __restrict__ part_max,
    float* __restrict__ part_sum, float* __restrict__ part_acc, float scale, int window, int num_heads,
    int num_kv_heads, int head_dim, int block_size, int max_blocks, int blocks_per_partition,
    int64_t stride_kn, int64_t stride_ks, int64_t stride_kh,
    int64_t stride_vn, int64_t stride_vs, int64_t stride_vh) {
  extern __shared__ float smem[];
  const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z, num_partitions = gridDim.z;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int seq_len = seq_lens[seq];
  const int num_blocks = (seq_len + block_size - 1) / block_size;
  const int first = window > 0 ? max(0, seq_len - window) : 0;
  const int j_begin = first / block_size + part * blocks_per_partition;
  const int j_end = min(j_begin + blocks_per_partition, num_blocks);
  const int64_t row = (int64_t)seq * num_heads + head;
  float* s_q = load_query(q, row, head_dim, smem);
  float* s_logits = s_q + head_dim;
  float* s_probs = s_logits + block_size;

  const SoftmaxState st = attend_blocks<T>(
      s_q, s_logits, s_probs, k_pool, v_pool, block_tables + (int64_t)seq * max_blocks, kv_head, seq_len, first,
      j_begin, j_end, scale, head_dim, block_size, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs,
      stride_vh);

  const int64_t slot = row * num_partitions + part;  // [B, H, P]
  if (threadIdx.x == 0) {
    part_max[slot] = st.m;
    part_sum[slot] = st.l;
  }
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
    const int d = threadIdx.x + i * NUM_THREADS;
    if (d < head_dim) part_acc[slot * head_dim + d] = st.acc[i];
  }
}

// Split-K, step 2: thread block (query head, sequence) combines the P states,
//     M = max_p m_p,   out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,
// each thread for its own dims; the P values of m and l are read by every thread (one cached load).
template <typename T>
__global__ void __launch_bounds__(NUM_THREADS) paged_decode_reduce_kernel(
    const float* __restrict__ part_max, const float* __restrict__ part_sum, const float* __restrict__ part_acc,
    T* __restrict__ out, int num_heads, int head_dim, int num_partitions) {
  const int64_t row = (int64_t)blockIdx.y * num_heads + blockIdx.x;
  const int64_t first_slot = row * num_partitions;
  float big_m = -INFINITY;
  for (int p = 0; p < num_partitions; ++p) big_m = fmaxf(big_m, part_max[first_slot + p]);

  float l = 0.f, acc[MAX_DIMS_PER_THREAD] = {0.f, 0.f, 0.f, 0.f};
  for (int p = 0; p < num_partitions; ++p) {
    const int64_t slot = first_slot + p;
    const float m_p = part_max[slot];
    const float w = m_p == -INFINITY ? 0.f : expf(m_p - big_m);  // empty: weight 0, never exp(-inf - -inf)
    l += w * part_sum[slot];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
      const int d = threadIdx.x + i * NUM_THREADS;
      if (d < head_dim) acc[i] += w * part_acc[slot * head_dim + d];
    }
  }
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
    const int d = threadIdx.x + i * NUM_THREADS;
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

// Host-side split-K launch: the partitions on grid (H, B, P), then the reduce on grid (H, B).
// part_max and part_sum hold B * H * P floats, part_acc B * H * P * D (the caller allocates them).
template <typename T>
cudaError_t launch_paged_decode_split(const T* q, const T* k_pool, const T* v_pool, const int32_t* block_tables,
                                      const int32_t* seq_lens, T* out, float* part_max, float* part_sum,
                                      float* part_acc, float scale, int window, int batch, int num_heads,
                                      int num_kv_heads, int head_dim, int block_size, int max_blocks,
                                      int num_partitions, int blocks_per_partition, int64_t stride_kn,
                                      int64_t stride_ks, int64_t stride_kh, int64_t stride_vn, int64_t stride_vs,
                                      int64_t stride_vh, cudaStream_t stream) {
  if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0) return cudaErrorInvalidValue;
  if (num_partitions < 1 || num_partitions > MAX_GRID_Z || blocks_per_partition < 1) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  const size_t smem_bytes = (size_t)(head_dim + 2 * block_size) * sizeof(float);
  paged_decode_partition_kernel<T><<<dim3(num_heads, batch, num_partitions), NUM_THREADS, smem_bytes, stream>>>(
      q, k_pool, v_pool, block_tables, seq_lens, part_max, part_sum, part_acc, scale, window, num_heads,
      num_kv_heads, head_dim, block_size, max_blocks, blocks_per_partition, stride_kn, stride_ks, stride_kh,
      stride_vn, stride_vs, stride_vh);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  paged_decode_reduce_kernel<T><<<dim3(num_heads, batch), NUM_THREADS, 0, stream>>>(
      part_max, part_sum, part_acc, out, num_heads, head_dim, num_partitions);
  return cudaGetLastError();
}

// Explicit instantiations: one kernel per storage type ends up in the cubin.
#define SERVELAB_INSTANTIATE(T)                                                                         \
  template cudaError_t launch_paged_decode<T>(const T*, const T*, const T*, const int32_t*, const int32_t*, \
                                              T*, float, int, int, int, int, int, int, int, int64_t, int64_t, \
                                              int64_t, int64_t, int64_t, int64_t, cudaStream_t);
#define SERVELAB_INSTANTIATE_SPLIT(T)                                                                     \
  template cudaError_t launch_paged_decode_split<T>(const T*, const T*, const T*, const int32_t*,              \
                                                    const int32_t*, T*, float*, float*, float*, float, int, int, \
                                                    int, int, int, int, int, int, int, int64_t, int64_t, int64_t, \
                                                    int64_t, int64_t, int64_t, cudaStream_t);
SERVELAB_INSTANTIATE(float)
SERVELAB_INSTANTIATE(__half)
SERVELAB_INSTANTIATE(__nv_bfloat16)
SERVELAB_INSTANTIATE_SPLIT(float)
SERVELAB_INSTANTIATE_SPLIT(__half)
SERVELAB_INSTANTIATE_SPLIT(__nv_bfloat16)
#undef SERVELAB_INSTANTIATE
#undef SERVELAB_INSTANTIATE_SPLIT

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
                                    int64_t window, int64_t num_partitions, int64_t blocks_per_partition) {
  const T* q_ptr = static_cast<const T*>(q.data_ptr());
  const T* k_ptr = static_cast<const T*>(k_pool.data_ptr());
  const T* v_ptr = static_cast<const T*>(v_pool.data_ptr());
  T* out_ptr = static_cast<T*>(out.data_ptr());
  const int batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (num_partitions == 1) {
    return servelab::launch_paged_decode<T>(
        q_ptr, k_ptr, v_ptr, block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out_ptr,
        static_cast<float>(scale), static_cast<int>(window), batch, num_heads, k_pool.size(2), head_dim,
        k_pool.size(1), block_tables.size(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), stream);
  }
  // split-K: the partitions' fp32 states, m and l [B, H, P] and acc [B, H, P, D]
  const auto f32 = q.options().dtype(at::kFloat);
  torch::Tensor part_max = torch::empty({batch, num_heads, num_partitions}, f32);
  torch::Tensor part_sum = torch::empty({batch, num_heads, num_partitions}, f32);
  torch::Tensor part_acc = torch::empty({batch, num_heads, num_partitions, head_dim}, f32);
  return servelab::launch_paged_decode_split<T>(
      q_ptr, k_ptr, v_ptr, block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out_ptr,
      part_max.data_ptr<float>(), part_sum.data_ptr<float>(), part_acc.data_ptr<float>(), static_cast<float>(scale),
      static_cast<int>(window), batch, num_heads, k_pool.size(2), head_dim, k_pool.size(1), block_tables.size(1),
      static_cast<int>(num_partitions), static_cast<int>(blocks_per_partition), k_pool.stride(0), k_pool.stride(1),
      k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), stream);
}

// The Python launcher has already run check_paged_inputs and chosen the partitions
// (split_k.partition_plan); here we only guard the layout. num_partitions 1: the one-pass kernel.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                           int64_t num_partitions, int64_t blocks_per_partition) {
  TORCH_CHECK(q.is_cuda() && q.is_contiguous(), "q must be a contiguous CUDA tensor");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables/lengths must be contiguous");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, "pools must be contiguous in D");
  TORCH_CHECK(num_partitions >= 1 && num_partitions <= servelab::MAX_GRID_Z && blocks_per_partition >= 1,
              "num_partitions must be in 1..", servelab::MAX_GRID_Z, " and blocks_per_partition >= 1");
  const c10::cuda::CUDAGuard guard(q.device());
  torch::Tensor out = torch::empty_like(q);
  cudaError_t err;
  switch (q.scalar_type()) {
    case at::kFloat:
      err = run_paged_decode<float>(q, k_pool, v_pool, block_tables, seq_lens, out, scale, window, num_partitions,
                                    blocks_per_partition);
      break;
    case at::kHalf:
      err = run_paged_decode<__half>(q, k_pool, v_pool, block_tables, seq_lens, out, scale, window, num_partitions,
                                     blocks_per_partition);
      break;
    case at::kBFloat16:
      err = run_paged_decode<__nv_bfloat16>(q, k_pool, v_pool, block_tables, seq_lens, out, scale, window,
                                            num_partitions, blocks_per_partition);
      break;
    default: TORCH_CHECK(false, "q: dtype must be float32, float16 or bfloat16");
  }
  TORCH_CHECK(err == cudaSuccess, "paged_decode launch failed: ", cudaGetErrorString(err));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "paged decode attention (q, k_pool, v_pool, block_tables, seq_lens, scale, window, num_partitions, "
        "blocks_per_partition)");
}
#endif  // SERVELAB_TORCH_EXTENSION
