"""Hand-written CUDA C++ RMSNorm (forward and fused residual add), JIT-built on first use.

One block per row; 16-byte vector loads where the row allows; the sum of squares in fp32,
reduced with warp shuffles then across warps through shared memory; HF's cast order (the
normalized value rounded to the input dtype before the weight multiply). fp32/fp16/bf16 for
x, residual and weight through templates. Built with torch.utils.cpp_extension.load_inline
and cached by torch in its extensions directory.
"""

import functools

import torch

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename T> __device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }

// Sum over the block: shuffles within each warp, then the warp totals through shared memory.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_totals[32];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x + 31) / 32 ? warp_totals[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    if (lane == 0) warp_totals[0] = v;
  }
  __syncthreads();
  return warp_totals[0];
}

// VEC elements per 16-byte access (the scalar kernel below takes rows whose length or alignment
// forbids vectors). The row is read twice, the second time from L1/L2, so any D works.
template <typename T, typename R, typename W, typename O, int VEC>
__global__ void rms_norm_kernel(const T* __restrict__ x, const R* __restrict__ residual,
                                const W* __restrict__ weight, O* __restrict__ y, T* __restrict__ sum_out,
                                int64_t D, int64_t x_stride, int64_t r_stride, float eps) {
  using S = T;  // the sum is rounded to the input dtype (callers pass residual of x's dtype)
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const R* rr = residual ? residual + row * r_stride : nullptr;
  S* sr = sum_out ? sum_out + row * D : nullptr;
  float sq = 0.f;
  for (int64_t i = threadIdx.x * VEC; i < D; i += blockDim.x * VEC) {
    alignas(16) T xv[VEC];
    *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(xr + i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float v = to_f(xv[k]);
      if (rr) { xv[k] = from_f<S>(v + to_f(rr[i + k])); v = to_f(xv[k]); }
      sq += v * v;
    }
    if (sr) *reinterpret_cast<uint4*>(sr + i) = *reinterpret_cast<uint4*>(xv);
  }
  const float rstd = rsqrtf(block_sum(sq) / static_cast<float>(D) + eps);
  const S* src = sr ? sr : xr;
  for (int64_t i = threadIdx.x * VEC; i < D; i += blockDim.x * VEC) {
    alignas(16) T xv[VEC];
    *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(src + i);
    O out[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float normalized = to_f(from_f<S>(to_f(xv[k]) * rstd));  // HF: round, then weight
      out[k] = from_f<O>(normalized * to_f(weight[i + k]));
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[row * D + i + k] = out[k];
  }
}

// Scalar fallback for rows whose length or alignment does not allow 16-byte vectors.
template <typename T, typename R, typename W, typename O>
__global__ void rms_norm_kernel_scalar(const T* __restrict__ x, const R* __restrict__ residual,
                                       const W* __restrict__ weight, O* __restrict__ y, T* __restrict__ sum_out,
                                       int64_t D, int64_t x_stride, int64_t r_stride, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const R* rr = residual ? residual + row * r_stride : nullptr;
  T* sr = sum_out ? sum_out + row * D : nullptr;
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    T xv = xr[i];
    if (rr) { xv = from_f<T>(to_f(xv) + to_f(rr[i])); sr[i] = xv; }
    const float v = to_f(xv);
    sq += v * v;
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

template <typename T, typename W, typename O>
void launch(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
            at::Tensor& y, std::optional<at::Tensor>& sum_out, int64_t rows, int64_t D, float eps) {
  using CT = typename cuda_type<T>::type;
  using CW = typename cuda_type<W>::type;
  using CO = typename cuda_type<O>::type;
  constexpr int VEC = 16 / sizeof(CT);
  const CT* xp = reinterpret_cast<const CT*>(x.data_ptr());
  const CT* rp = residual ? reinterpret_cast<const CT*>(residual->data_ptr()) : nullptr;
  CT* sp = sum_out ? reinterpret_cast<CT*>(sum_out->data_ptr()) : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const bool aligned = D % VEC == 0 && xs % VEC == 0 && rs % VEC == 0 &&
                       reinterpret_cast<uintptr_t>(xp) % 16 == 0 && reinterpret_cast<uintptr_t>(rp) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(sp) % 16 == 0;
  const int threads = static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, ((D / VEC + 31) / 32) * 32)));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto wp = reinterpret_cast<const CW*>(weight.data_ptr());
  auto yp = reinterpret_cast<CO*>(y.data_ptr());
  if (aligned) {
    rms_norm_kernel<CT, CT, CW, CO, VEC><<<rows, threads, 0, stream>>>(xp, rp, wp, yp, sp, D, xs, rs, eps);
  } else {
    rms_norm_kernel_scalar<CT, CT, CW, CO><<<rows, threads, 0, stream>>>(xp, rp, wp, yp, sp, D, xs, rs, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define DISPATCH_W(T, O)                                                                       \
  switch (weight.scalar_type()) {                                                              \
    case at::kFloat: launch<T, float, O>(x, residual, weight, y, sum_out, rows, D, eps); break; \
    case at::kHalf: launch<T, at::Half, O>(x, residual, weight, y, sum_out, rows, D, eps); break; \
    case at::kBFloat16: launch<T, at::BFloat16, O>(x, residual, weight, y, sum_out, rows, D, eps); break; \
    default: TORCH_CHECK(false, "unsupported weight dtype");                                  \
  }

// x, residual: [rows, D] with unit column stride; y (and sum_out): contiguous [rows, D].
void rms_norm_forward(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                      at::Tensor y, std::optional<at::Tensor> sum_out, double eps) {
  const int64_t rows = x.size(0), D = x.size(1);
  if (rows == 0) return;
  const auto out = y.scalar_type();
  #define FOR_X(T)                                                                  \
    if (out == at::kFloat) { DISPATCH_W(T, float) }                                 \
    else if (out == at::kHalf) { DISPATCH_W(T, at::Half) }                          \
    else { DISPATCH_W(T, at::BFloat16) }
  switch (x.scalar_type()) {
    case at::kFloat: { FOR_X(float) break; }
    case at::kHalf: { FOR_X(at::Half) break; }
    case at::kBFloat16: { FOR_X(at::BFloat16) break; }
    default: TORCH_CHECK(false, "unsupported x dtype");
  }
}
"""

CPP_SOURCE = """
void rms_norm_forward(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                      at::Tensor y, std::optional<at::Tensor> sum_out, double eps);
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


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit column stride, a view where the layout allows."""
    D = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, D)
    except RuntimeError:
        return x.reshape(-1, D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _extension().rms_norm_forward(_rows(x), None, weight.contiguous(), y.view(-1, x.shape[-1]), None, float(eps))
    return y


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.dtype != x.dtype:
        raise TypeError(f"impl='cuda' fused add needs residual in x's dtype {x.dtype}, got {residual.dtype}")
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    D = x.shape[-1]
    _extension().rms_norm_forward(_rows(x), _rows(residual), weight.contiguous(), y.view(-1, D),
                                  summed.view(-1, D), float(eps))
    return y, summed
