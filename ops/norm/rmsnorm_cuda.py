"""Hand-written CUDA C++ RMSNorm (forward and fused residual add), JIT-built on first use.

Short rows get one warp each, long rows one block each; the row is held in registers as 16-byte
vectors (loaded and stored 16 bytes at a time) and read once; the sum of squares is taken in
fp32 and reduced with warp shuffles (then across warps through shared memory); HF's cast order
(the normalized value rounded to the input dtype before the weight multiply). fp32/fp16/bf16
for x, residual and weight through templates; rows that are too long or misaligned for vectors
take a scalar kernel that reads them twice. Built with torch.utils.cpp_extension.load_inline
and cached by torch in its extensions directory.

Forward only: a call that autograd would record (grad mode on, an input requiring grad) raises
NotImplementedError instead of returning outputs cut off from the graph.
"""

import functools

import torch

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename T> __device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  return v;
}

// Sum over a one-row block: shuffles within each warp, then the warp totals through shared memory.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_totals[32];
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_sum(lane < (blockDim.x + 31) / 32 ? warp_totals[lane] : 0.f);
    if (lane == 0) warp_totals[0] = v;
  }
  __syncthreads();
  return warp_totals[0];
}

// Each thread holds CHUNKS 16-byte chunks (VEC elements each) of its row in registers, so the
// row is read once. blockDim.x threads share a row: 32 (one warp per row, blockDim.y rows per
// block) for short rows, up to 1024 (one row per block) for long ones.
template <typename T, typename W, typename O, int VEC, int CHUNKS>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                const W* __restrict__ weight, O* __restrict__ y, T* __restrict__ sum_out,
                                int64_t rows, int64_t D, int64_t x_stride, int64_t r_stride, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // only warp-per-row blocks can overhang, and they never __syncthreads
  const T* xr = x + row * x_stride;
  alignas(16) T v[CHUNKS][VEC];
  float sq = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int64_t i = (static_cast<int64_t>(c) * blockDim.x + threadIdx.x) * VEC;
    if (i < D) {
      *reinterpret_cast<uint4*>(v[c]) = *reinterpret_cast<const uint4*>(xr + i);
      if (residual) {  // the sum, rounded to the input dtype as HF's residual + hidden_states is
        alignas(16) T r[VEC];
        *reinterpret_cast<uint4*>(r) = *reinterpret_cast<const uint4*>(residual + row * r_stride + i);
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[c][k] = from_f<T>(to_f(v[c][k]) + to_f(r[k]));
        *reinterpret_cast<uint4*>(sum_out + row * D + i) = *reinterpret_cast<uint4*>(v[c]);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) sq += to_f(v[c][k]) * to_f(v[c][k]);
    }
  }
  const float total = blockDim.x == 32 ? warp_sum(sq) : block_sum(sq);
  const float rstd = rsqrtf(total / static_cast<float>(D) + eps);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int64_t i = (static_cast<int64_t>(c) * blockDim.x + threadIdx.x) * VEC;
    if (i < D) {
      alignas(16) O out[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {  // HF: round the normalized value, then multiply by the weight
        out[k] = from_f<O>(to_f(from_f<T>(to_f(v[c][k]) * rstd)) * to_f(weight[i + k]));
      }
#pragma unroll
      for (int b = 0; b < static_cast<int>(sizeof(O)) * VEC / 16; ++b) {
        reinterpret_cast<uint4*>(y + row * D + i)[b] = reinterpret_cast<const uint4*>(out)[b];
      }
    }
  }
}

// Any row: one row per block, read twice (the second time from cache), scalar accesses. Takes
// rows too long for registers and rows whose length or alignment forbids 16-byte vectors.
template <typename T, typename W, typename O>
__global__ void rms_norm_kernel_scalar(const T* __restrict__ x, const T* __restrict__ residual,
                                       const W* __restrict__ weight, O* __restrict__ y, T* __restrict__ sum_out,
                                       int64_t D, int64_t x_stride, int64_t r_stride, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const T* rr = residual ? residual + row * r_stride : nullptr;
  T* sr = sum_out ? sum_out + row * D : nullptr;
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    T xv = xr[i];
    if (rr) { xv = from_f<T>(to_f(xv) + to_f(rr[i])); sr[i] = xv; }
    const float f = to_f(xv);
    sq += f * f;
  }
  const float rstd = rsqrtf(block_sum(sq) / static_cast<float>(D) + eps);
  const T* src = sr ? sr : xr;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float normalized = to_f(from_f<T>(to_f(src[i]) * rstd));
    y[row * D + i] = from_f<O>(normalized * to_f(weight[i]));
  }
}

template <typename T> struct cuda_type { using type = T; };
template <> struct cuda_type<at::BFloat16> { using type = __nv_bfloat16; };
template <> struct cuda_type<at::Half> { using type = __half; };

template <typename T, typename W, typename O, int VEC, int CHUNKS>
void launch_vec(dim3 grid, dim3 block, cudaStream_t stream, const T* x, const T* r, const W* w, O* y, T* s,
                int64_t rows, int64_t D, int64_t xs, int64_t rs, float eps) {
  rms_norm_kernel<T, W, O, VEC, CHUNKS><<<grid, block, 0, stream>>>(x, r, w, y, s, rows, D, xs, rs, eps);
}

template <typename T0, typename W0, typename O0>
void launch(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
            at::Tensor& y, std::optional<at::Tensor>& sum_out, float eps) {
  using T = typename cuda_type<T0>::type;
  using W = typename cuda_type<W0>::type;
  using O = typename cuda_type<O0>::type;
  constexpr int VEC = 16 / sizeof(T);
  const int64_t rows = x.size(0), D = x.size(1);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* rp = residual ? reinterpret_cast<const T*>(residual->data_ptr()) : nullptr;
  T* sp = sum_out ? reinterpret_cast<T*>(sum_out->data_ptr()) : nullptr;
  const W* wp = reinterpret_cast<const W*>(weight.data_ptr());
  O* yp = reinterpret_cast<O*>(y.data_ptr());
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool aligned = D % VEC == 0 && xs % VEC == 0 && rs % VEC == 0 &&
                       reinterpret_cast<uintptr_t>(xp) % 16 == 0 && reinterpret_cast<uintptr_t>(rp) % 16 == 0;
  const int64_t chunks = D / VEC;
  if (aligned && chunks <= 32 * 4) {  // short rows: one warp each, 4 rows per block
    const dim3 block(32, 4), grid((rows + 3) / 4);
    if (chunks <= 32) launch_vec<T, W, O, VEC, 1>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
    else if (chunks <= 64) launch_vec<T, W, O, VEC, 2>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
    else launch_vec<T, W, O, VEC, 4>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
  } else if (aligned && chunks <= 512 * 8) {  // long rows: one block of <= 512 threads each
    const int per_thread = chunks <= 512 ? 1 : chunks <= 1024 ? 2 : chunks <= 2048 ? 4 : 8;
    const int threads = static_cast<int>(((chunks + per_thread - 1) / per_thread + 31) / 32 * 32);
    const dim3 block(threads, 1), grid(rows);
    if (per_thread == 1) launch_vec<T, W, O, VEC, 1>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
    else if (per_thread == 2) launch_vec<T, W, O, VEC, 2>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
    else if (per_thread == 4) launch_vec<T, W, O, VEC, 4>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
    else launch_vec<T, W, O, VEC, 8>(grid, block, stream, xp, rp, wp, yp, sp, rows, D, xs, rs, eps);
  } else {
    const int threads = static_cast<int>(std::min<int64_t>(1024, (D + 31) / 32 * 32));
    rms_norm_kernel_scalar<T, W, O><<<rows, threads, 0, stream>>>(xp, rp, wp, yp, sp, D, xs, rs, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x, residual: [rows, D] with unit column stride; y (and sum_out): contiguous [rows, D].
// y's dtype is torch's promotion of x's and the weight's: x's when they match, else fp32.
void dispatch(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
              at::Tensor y, std::optional<at::Tensor> sum_out, float e) {
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  #define SAME(X, T) if (xt == X && wt == X) { launch<T, T, T>(x, residual, weight, y, sum_out, e); return; }
  #define MIXED(X, WT, T, W) if (xt == X && wt == WT) { launch<T, W, float>(x, residual, weight, y, sum_out, e); return; }
  SAME(at::kFloat, float)
  SAME(at::kHalf, at::Half)
  SAME(at::kBFloat16, at::BFloat16)
  MIXED(at::kFloat, at::kHalf, float, at::Half)
  MIXED(at::kFloat, at::kBFloat16, float, at::BFloat16)
  MIXED(at::kHalf, at::kFloat, at::Half, float)
  MIXED(at::kHalf, at::kBFloat16, at::Half, at::BFloat16)
  MIXED(at::kBFloat16, at::kFloat, at::BFloat16, float)
  MIXED(at::kBFloat16, at::kHalf, at::BFloat16, at::Half)
  #undef SAME
  #undef MIXED
  TORCH_CHECK(false, "unsupported dtypes for the CUDA RMSNorm");
}

// t (..., D) as [rows, D] with unit column stride: a view where the layout allows, else a copy.
at::Tensor as_rows(const at::Tensor& t) {
  return (t.stride(-1) == 1 ? t : t.contiguous()).reshape({-1, t.size(-1)});
}

// Returns {y} or, with a residual, {y, x + residual}; inputs validated by ops (same dtype for the
// residual). Allocation and reshapes happen here, not in Python: this is the per-call host path.
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                         const at::Tensor& weight, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(-1);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::promote_types(x.scalar_type(), weight.scalar_type())));
  std::optional<at::Tensor> sum_out, rows_residual;
  if (residual) {
    sum_out = at::empty(x.sizes(), x.options());
    rows_residual = as_rows(*residual);
  }
  if (x.numel() > 0) {
    dispatch(as_rows(x), rows_residual, weight.contiguous(), y.view({-1, D}),
             sum_out ? std::optional<at::Tensor>(sum_out->view({-1, D})) : std::nullopt, static_cast<float>(eps));
  }
  if (sum_out) return {y, *sum_out};
  return {y};
}
"""

CPP_SOURCE = """
std::vector<at::Tensor> rms_norm_forward(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                         const at::Tensor& weight, double eps);
"""


@functools.cache
def _extension():
    if not torch.cuda.is_available():
        raise ValueError("impl='cuda' needs a CUDA device, and none is available")
    from torch.utils.cpp_extension import CUDA_HOME, load_inline

    if CUDA_HOME is None:
        raise ValueError("impl='cuda' JIT-builds its kernel with nvcc, and no CUDA toolkit (nvcc) was found")
    major, minor = torch.cuda.get_device_capability()
    return load_inline(
        name=f"qwen3_rmsnorm_cuda_sm{major}{minor}",
        cpp_sources=CPP_SOURCE,
        cuda_sources=CUDA_SOURCE,
        functions=["rms_norm_forward"],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"],
        verbose=False,
    )


def _refuse_grad(*tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise NotImplementedError(
            "impl='cuda' has no backward: use impl='triton' or 'torch' where gradients are needed, "
            "or call it under torch.no_grad()"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _refuse_grad(x, weight)
    return _extension().rms_norm_forward(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _refuse_grad(x, residual, weight)
    if residual.dtype != x.dtype:
        raise TypeError(f"impl='cuda' fused add needs residual in x's dtype {x.dtype}, got {residual.dtype}")
    y, summed = _extension().rms_norm_forward(x, residual, weight, eps)
    return y, summed
