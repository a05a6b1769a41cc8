// ATen glue for CUDA tensors: allocation, device guard, current stream, error reporting.
// Compiled in every build through device-generic c10 APIs (no c10/cuda header, which the
// CPU build of torch cannot compile); the launchers themselves are linked only when
// setup.py builds displacement_cuda.cu and defines WITH_CUDA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "displacement.h"
#include "displacement_ops.h"

namespace megatron_jreg {
namespace {

#ifdef WITH_CUDA
DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    default: TORCH_CHECK(false, "megatron_jreg: no CUDA displacement kernel for dtype ", t);
  }
}

void* current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

void check_launch(int code, const char* what) {
  TORCH_CHECK(code == 0, "megatron_jreg: ", what, " kernel launch failed: ", cuda_error_string(code));
}
#endif

[[noreturn]] void not_built() {
  TORCH_CHECK(false,
              "megatron_jreg: the extension was built without CUDA (CPU build of torch, no nvcc, "
              "or MEGATRON_JREG_NO_CUDA=1); reinstall with a CUDA torch and nvcc, or use "
              "impl='torch'");
}

}  // namespace

bool cuda_built() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<at::Tensor> displacement_forward_cuda(const at::Tensor& a, const at::Tensor& b,
                                                  int64_t tokens, int64_t hidden) {
#ifdef WITH_CUDA
  c10::DeviceGuard guard(a.device());
  const auto acc = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor psi = at::empty({tokens}, a.options().dtype(acc));
  at::Tensor stats = at::empty({tokens, kStats}, a.options().dtype(acc));
  check_launch(launch_displacement_forward_cuda(to_dtype(a.scalar_type()), a.const_data_ptr(),
                                                b.const_data_ptr(), psi.mutable_data_ptr(),
                                                stats.mutable_data_ptr(), tokens, hidden,
                                                current_stream(a.device())),
               "forward");
  return {psi, stats};
#else
  (void)a, (void)b, (void)tokens, (void)hidden;
  not_built();
#endif
}

std::vector<at::Tensor> displacement_backward_cuda(const at::Tensor& grad_psi,
                                                   const at::Tensor& a, const at::Tensor& b,
                                                   const at::Tensor& stats, int64_t tokens,
                                                   int64_t hidden) {
#ifdef WITH_CUDA
  c10::DeviceGuard guard(a.device());
  at::Tensor grad_a = at::empty_like(a);
  at::Tensor grad_b = at::empty_like(b);
  check_launch(launch_displacement_backward_cuda(
                   to_dtype(a.scalar_type()), grad_psi.const_data_ptr(), a.const_data_ptr(),
                   b.const_data_ptr(), stats.const_data_ptr(), grad_a.mutable_data_ptr(),
                   grad_b.mutable_data_ptr(), tokens, hidden, current_stream(a.device())),
               "backward");
  return {grad_a, grad_b};
#else
  (void)grad_psi, (void)a, (void)b, (void)stats, (void)tokens, (void)hidden;
  not_built();
#endif
}

}  // namespace megatron_jreg
