// The host side of the Triton RMSNorm in C++: look up the compiled kernel, allocate, launch; and
// the autograd nodes of rms_norm and fused_add_rms_norm. A Python call and a Python autograd.Function
// cost several microseconds each on the host, which F.rms_norm's C++ path does not pay (notes,
// items 13 and 15).
//
// ops/rmsnorm_triton.py compiles each kernel through Triton on its first call and registers it
// here (add_forward_plan, add_backward_plan). Later calls on contiguous tensors on the current
// CUDA device launch it from here; anything else (a first call, a strided view, the CPU
// interpreter) takes the Python path, which the autograd nodes call back into. No CUDA headers:
// the driver's cuLaunchKernel is looked up in the already loaded libcuda.
#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

namespace qwen3_rmsnorm {

// A compiled kernel and how to launch it. types has one letter per kernel parameter, as Triton
// lists them: O a pointer (the kernel's tensors, then null scratch pointers), i int32, l int64,
// f fp32 (eps, the only float argument).
struct Kernel {
  void* function;
  unsigned threads, shared_bytes;
  std::string types;
};

struct ForwardPlan {
  Kernel kernel;
  int64_t block_rows;  // rows per program; 0: the looped kernel, one row per program
};

struct BackwardPlan {
  Kernel rows, sum;  // _backward (dx, dweight partial sums), _sum_partials (dweight)
  int64_t block_rows, max_programs, sum_programs;
};

// What Triton specializes a kernel on, for contiguous inputs: the dtypes, D, whether row indices
// need 64 bits and which pointers are not 16-byte aligned; the device too, as a compiled function
// belongs to one. Packed: {flags, D, dtypes and device}.
using Key = std::array<int64_t, 3>;

struct KeyHash {
  size_t operator()(const Key& k) const { return std::hash<int64_t>()(k[0] ^ (k[1] << 20) ^ (k[2] * 1000003)); }
};

std::mutex plans_mutex;  // backward nodes run on autograd's threads, without the GIL
std::unordered_map<Key, ForwardPlan, KeyHash> forward_plans;
std::unordered_map<Key, BackwardPlan, KeyHash> backward_plans;

using LaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                             unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream, void** params,
                             void** extra);
LaunchKernel launch_kernel = nullptr;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Key parts: up to 8 one-byte dtype codes (0 for an absent tensor), and the alignment bits.
int64_t dtype_codes(std::initializer_list<const Tensor*> tensors) {
  int64_t code = 0, shift = 0;
  for (const Tensor* t : tensors) code |= int64_t(t ? int(t->scalar_type()) + 1 : 0) << (8 * shift++);
  return code;
}

int64_t unaligned_bits(std::initializer_list<const Tensor*> tensors) {
  int64_t bits = 0, shift = 0;
  for (const Tensor* t : tensors) bits |= int64_t(t && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16) << shift++;
  return bits;
}

// Above the dtype codes. (get_device() returns an 8-bit DeviceIndex, which promotes to int: shifted
// by 32 as an int, the device was lost and two GPUs' kernels shared keys.)
int64_t device_code(const Tensor& t) { return int64_t(t.get_device() + 1) << 32; }

Key forward_key(const Tensor& x, const OptionalTensor& residual, const Tensor& weight, bool store_rstd) {
  const Tensor* r = residual ? &*residual : nullptr;
  const int64_t D = x.size(-1), wide = x.numel() / D >= (int64_t(1) << 31);
  return {int64_t(store_rstd) | wide << 1 | unaligned_bits({&x, r, &weight}) << 2, D,
          dtype_codes({&x, r, &weight}) | device_code(x)};
}

// The backward kernel reads dy as DS when there is no d_sum (HAS_DS, compiled in, says which).
Key backward_key(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                 const OptionalTensor& d_sum) {
  const int64_t D = x.size(-1), wide = x.numel() / D >= (int64_t(1) << 31);
  const Tensor& ds = d_sum ? *d_sum : dy;
  return {int64_t(d_sum.has_value()) | wide << 1 | unaligned_bits({&dy, &x, &weight, &rstd, &ds}) << 2, D,
          dtype_codes({&dy, &x, &weight, &ds}) | device_code(x)};
}

// types must be n_pointers pointers, then the scalars (pattern: i an int of either width, f eps),
// then Triton's scratch pointers.
Kernel kernel_of(uintptr_t function, int64_t warps, int64_t shared_bytes, const std::string& types,
                 size_t n_pointers, const std::string& scalars) {
  const size_t scalars_end = n_pointers + scalars.size();
  bool expected = types.size() >= scalars_end && types.size() <= 32;
  for (size_t i = 0; expected && i < types.size(); ++i) {
    const char want = i < n_pointers || i >= scalars_end ? 'O' : scalars[i - n_pointers];
    expected = types[i] == want || (want == 'i' && types[i] == 'l');
  }
  if (!expected) throw std::invalid_argument("unexpected kernel parameter types '" + types + "'");
  if (!launch_kernel) {
    void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    launch_kernel = libcuda ? reinterpret_cast<LaunchKernel>(dlsym(libcuda, "cuLaunchKernel")) : nullptr;
    if (!launch_kernel) throw std::runtime_error("cuLaunchKernel not found in a loaded libcuda.so.1");
  }
  return Kernel{reinterpret_cast<void*>(function), unsigned(warps * 32), unsigned(shared_bytes), types};
}

// Launch with the pointers and ints in the order of the kernel's parameters, on the current stream.
void launch(const Kernel& kernel, int64_t programs, const Tensor& on, std::initializer_list<void*> pointers,
            std::initializer_list<int64_t> ints, float eps = 0.f) {
  union Value {
    void* pointer;
    int32_t i32;
    int64_t i64;
    float f32;
  } values[32];
  void* params[32];
  auto pointer = pointers.begin();
  auto integer = ints.begin();
  for (size_t i = 0; i < kernel.types.size(); ++i) {
    switch (kernel.types[i]) {
      case 'O': values[i].pointer = pointer != pointers.end() ? *pointer++ : nullptr; break;
      case 'i': values[i].i32 = int32_t(*integer++); break;
      case 'l': values[i].i64 = *integer++; break;
      default: values[i].f32 = eps; break;
    }
    params[i] = &values[i];
  }
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(on.device()).native_handle();
  const int error = launch_kernel(kernel.function, unsigned(programs), 1, 1, kernel.threads, 1, 1,
                                  kernel.shared_bytes, stream, params, nullptr);
  if (error != 0) throw std::runtime_error("cuLaunchKernel failed with CUDA error " + std::to_string(error));
}

// Whether the C++ path may serve these tensors: CUDA, contiguous, non-empty, on the current device.
bool servable(const Tensor& x, std::initializer_list<const Tensor*> others) {
  if (!x.is_cuda() || !x.is_contiguous() || x.numel() == 0) return false;
  for (const Tensor* t : others)
    if (t && !t->is_contiguous()) return false;
  return x.get_device() == c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
}

using ForwardOutputs = std::tuple<Tensor, Tensor, Tensor>;  // y, sum (undefined without a residual), rstd

std::optional<ForwardOutputs> forward_in_cpp(const Tensor& x, const OptionalTensor& residual, const Tensor& weight,
                                             double eps, bool store_rstd) {
  if (!servable(x, {&weight, residual ? &*residual : nullptr})) return std::nullopt;
  const ForwardPlan* plan;  // plans are never replaced or removed, and a map's elements stay put as it grows
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    const auto found = forward_plans.find(forward_key(x, residual, weight, store_rstd));
    if (found == forward_plans.end()) return std::nullopt;
    plan = &found->second;
  }
  const at::ScalarType in_dtype =
      residual ? c10::promoteTypes(x.scalar_type(), residual->scalar_type()) : x.scalar_type();
  const int64_t D = x.size(-1), n_rows = x.numel() / D;
  Tensor y = at::empty(x.sizes(), x.options().dtype(c10::promoteTypes(in_dtype, weight.scalar_type())));
  Tensor summed = residual ? at::empty(x.sizes(), x.options().dtype(in_dtype)) : Tensor();
  Tensor rstd = store_rstd ? at::empty({n_rows}, x.options().dtype(at::kFloat)) : Tensor();
  // As rmsnorm_triton.forward passes them: R and S are x without a residual, RSTD is y when not
  // stored; both row layouts are contiguous (inner n_rows, strides 0 and D).
  const std::initializer_list<void*> pointers = {
      x.data_ptr(), residual ? residual->data_ptr() : x.data_ptr(), weight.data_ptr(), y.data_ptr(),
      residual ? summed.data_ptr() : x.data_ptr(), store_rstd ? rstd.data_ptr() : y.data_ptr()};
  if (plan->block_rows)
    launch(plan->kernel, cdiv(n_rows, plan->block_rows), x, pointers, {n_rows, D, n_rows, 0, D, n_rows, 0, D}, eps);
  else
    launch(plan->kernel, n_rows, x, pointers, {n_rows, n_rows, 0, D, n_rows, 0, D}, eps);
  return ForwardOutputs{y, summed, rstd};
}

std::optional<std::pair<Tensor, Tensor>> backward_in_cpp(const Tensor& dy_in, const Tensor& x, const Tensor& weight,
                                                         const Tensor& rstd, const OptionalTensor& d_sum_in) {
  if (!servable(x, {&weight, &rstd})) return std::nullopt;
  const Tensor dy = dy_in.contiguous();
  const OptionalTensor d_sum = d_sum_in ? OptionalTensor(d_sum_in->contiguous()) : std::nullopt;
  const BackwardPlan* plan;
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    const auto found = backward_plans.find(backward_key(dy, x, weight, rstd, d_sum));
    if (found == backward_plans.end()) return std::nullopt;
    plan = &found->second;
  }
  const int64_t D = x.size(-1), n_rows = x.numel() / D;
  // rmsnorm_triton.backward_grid: programs over equal runs of whole row blocks.
  int64_t programs = std::min(plan->max_programs, cdiv(n_rows, plan->block_rows));
  const int64_t rows_per_program = cdiv(cdiv(n_rows, programs), plan->block_rows) * plan->block_rows;
  programs = cdiv(n_rows, rows_per_program);
  Tensor dx = at::empty(x.sizes(), x.options());
  Tensor partial = at::empty({programs * D}, x.options().dtype(at::kFloat));
  Tensor dw = at::empty(weight.sizes(), weight.options());
  void* ds = (d_sum ? *d_sum : dy).data_ptr();
  launch(plan->rows, programs, x,
         {dy.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), ds, dx.data_ptr(), partial.data_ptr()},
         {n_rows, D, rows_per_program, n_rows, 0, D});
  launch(plan->sum, plan->sum_programs, x, {partial.data_ptr(), dw.data_ptr()}, {programs, D});
  return std::make_pair(dx, dw);
}

py::object python_path(const char* name) { return py::module_::import("ops.rmsnorm_triton").attr(name); }

ForwardOutputs run_forward(const Tensor& x, const OptionalTensor& residual, const Tensor& weight, double eps) {
  if (auto outputs = forward_in_cpp(x, residual, weight, eps, true)) return *outputs;
  py::gil_scoped_acquire gil;
  const py::tuple out = python_path("forward")(x, weight, eps, residual, true);
  return {out[0].cast<Tensor>(), residual ? out[1].cast<Tensor>() : Tensor(), out[2].cast<Tensor>()};
}

std::pair<Tensor, Tensor> run_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                       const OptionalTensor& d_sum) {
  if (auto grads = backward_in_cpp(dy, x, weight, rstd, d_sum)) return *grads;
  py::gil_scoped_acquire gil;  // autograd's thread does not hold it
  const py::tuple out = python_path("backward")(dy, x, weight, rstd, d_sum);
  return {out[0].cast<Tensor>(), out[1].cast<Tensor>()};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RMSNormNode : torch::autograd::Function<RMSNormNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    auto [y, unused, rstd] = run_forward(x, std::nullopt, weight, eps);
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [dx, dw] = run_backward(grads[0], saved[0], saved[1], saved[2], std::nullopt);
    return {dx, dw, Tensor()};
  }
};

struct FusedAddRMSNormNode : torch::autograd::Function<FusedAddRMSNormNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& weight,
                               double eps) {
    auto [y, summed, rstd] = run_forward(x, residual, weight, eps);
    ctx->save_for_backward({summed, weight, rstd});  // the backward needs the normalized input, the sum
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["residual_dtype"] = residual.scalar_type();
    return {y, summed};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    auto [d_summed, dw] = run_backward(grads[0], saved[0], saved[1], saved[2], grads[1]);
    return {d_summed.to(ctx->saved_data["x_dtype"].toScalarType()),
            d_summed.to(ctx->saved_data["residual_dtype"].toScalarType()), dw, Tensor()};
  }
};

}  // namespace qwen3_rmsnorm

using namespace qwen3_rmsnorm;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_forward_plan", [](const Tensor& x, const OptionalTensor& residual, const Tensor& weight, bool store_rstd,
                               uintptr_t function, int64_t warps, int64_t shared_bytes, const std::string& types,
                               int64_t block_rows) {
    // Parameters: X R W Y S RSTD, then n_rows, D (one-pass only), eps and two row layouts of 3 ints.
    const Kernel kernel =
        kernel_of(function, warps, shared_bytes, types, 6, block_rows ? "iifiiiiii" : "ifiiiiii");
    std::lock_guard<std::mutex> lock(plans_mutex);
    forward_plans.emplace(forward_key(x, residual, weight, store_rstd), ForwardPlan{kernel, block_rows});
  });
  m.def("add_backward_plan", [](const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                const OptionalTensor& d_sum, py::tuple rows, py::tuple sum, int64_t block_rows,
                                int64_t max_programs, int64_t sum_programs) {
    // rows and sum: (function, warps, shared bytes, types) of _backward (DY X W RSTD DS DX DW_PARTIAL,
    // then n_rows, D, rows_per_program and a row layout) and of _sum_partials (PARTIAL DW, n_partials, D).
    auto kernel = [](const py::tuple& k, size_t n_pointers, const char* scalars) {
      return kernel_of(k[0].cast<uintptr_t>(), k[1].cast<int64_t>(), k[2].cast<int64_t>(), k[3].cast<std::string>(),
                       n_pointers, scalars);
    };
    BackwardPlan plan{kernel(rows, 7, "iiiiii"), kernel(sum, 2, "ii"), block_rows, max_programs, sum_programs};
    std::lock_guard<std::mutex> lock(plans_mutex);
    backward_plans.emplace(backward_key(dy, x, weight, rstd, d_sum), plan);
  });
  m.def("forward", [](const Tensor& x, const OptionalTensor& residual, const Tensor& weight, double eps,
                      bool store_rstd) -> py::object {
    // (y, sum or None, rstd or None), as rmsnorm_triton.forward returns them; None without a plan.
    const auto outputs = forward_in_cpp(x, residual, weight, eps, store_rstd);
    if (!outputs) return py::none();
    auto or_none = [](const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
    return py::make_tuple(std::get<0>(*outputs), or_none(std::get<1>(*outputs)), or_none(std::get<2>(*outputs)));
  });
  m.def("rms_norm", [](const Tensor& x, const Tensor& weight, double eps) {
    return RMSNormNode::apply(x, weight, eps);
  });
  m.def("fused_add_rms_norm", [](const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
    const variable_list out = FusedAddRMSNormNode::apply(x, residual, weight, eps);
    return std::make_tuple(out[0], out[1]);
  });
}
