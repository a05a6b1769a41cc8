// Python bindings of the fused displacement kernels: input checks, flattening to
// [tokens, hidden], and dispatch on the tensors' device. The autograd op is in Python
// (megatron_jreg/ops/displacement.py), so torch.compile sees it through torch.library.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "displacement.h"
#include "displacement_ops.h"

#ifndef MEGATRON_JREG_CUDA_SKIPPED
#define MEGATRON_JREG_CUDA_SKIPPED -1  // built outside setup.py: the reason is unknown
#endif

namespace megatron_jreg {
namespace {

bool supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// [..., hidden] -> (tokens, hidden); hidden may be 0 (psi is then 0.5).
std::pair<int64_t, int64_t> token_layout(const at::Tensor& a) {
  const int64_t hidden = a.size(-1);
  int64_t tokens = 1;
  for (int64_t d = 0; d + 1 < a.dim(); ++d) tokens *= a.size(d);
  return {tokens, hidden};
}

void check_pair(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.defined() && b.defined(), "token_displacement: a and b must be tensors");
  TORCH_CHECK(a.dim() >= 1,
              "token_displacement: inputs need at least one dimension (the hidden size), got a "
              "0-dim tensor");
  TORCH_CHECK(a.sizes() == b.sizes(), "token_displacement: a and b must have the same shape, got ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(),
              "token_displacement: a and b must have the same dtype, got ", a.scalar_type(),
              " and ", b.scalar_type(), "; cast one of them, or use impl='torch'");
  TORCH_CHECK(a.device() == b.device(), "token_displacement: a and b must be on the same device, got ",
              a.device(), " and ", b.device());
  TORCH_CHECK(supported(a.scalar_type()),
              "token_displacement: the fused kernel takes float32, float16, bfloat16 or float64, "
              "got ", a.scalar_type());
  TORCH_CHECK(a.is_cpu() || a.is_cuda(), "token_displacement: the fused kernel runs on CPU or "
              "CUDA tensors, got device ", a.device());
}

// Returns (psi shaped like a without its last dim, stats [tokens, 3]).
std::vector<at::Tensor> forward(const at::Tensor& a_in, const at::Tensor& b_in) {
  check_pair(a_in, b_in);
  // Non-contiguous inputs are copied once; contiguous ones (the model's case) are not.
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  const auto [tokens, hidden] = token_layout(a);
  std::vector<at::Tensor> out = a.is_cuda() ? displacement_forward_cuda(a, b, tokens, hidden)
                                            : displacement_forward_cpu(a, b, tokens, hidden);
  out[0] = out[0].view(a.sizes().slice(0, a.dim() - 1));
  return out;
}

// Returns (grad_a, grad_b), contiguous, in the inputs' dtype.
std::vector<at::Tensor> backward(const at::Tensor& grad_psi, const at::Tensor& a_in,
                                 const at::Tensor& b_in, const at::Tensor& stats) {
  check_pair(a_in, b_in);
  const auto [tokens, hidden] = token_layout(a_in);
  const auto acc = acc_dtype(a_in.scalar_type());
  TORCH_CHECK(grad_psi.numel() == tokens, "token_displacement backward: grad_psi has ",
              grad_psi.numel(), " elements for ", tokens, " tokens");
  TORCH_CHECK(grad_psi.scalar_type() == acc && stats.scalar_type() == acc,
              "token_displacement backward: grad_psi and stats must be ", acc, ", got ",
              grad_psi.scalar_type(), " and ", stats.scalar_type());
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == tokens && stats.size(1) == kStats &&
                  stats.is_contiguous(),
              "token_displacement backward: stats must be the contiguous [tokens, 3] tensor "
              "from the forward, got ", stats.sizes());
  TORCH_CHECK(grad_psi.device() == a_in.device() && stats.device() == a_in.device(),
              "token_displacement backward: grad_psi, stats and a must share a device");
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  const at::Tensor g = grad_psi.reshape({tokens}).contiguous();  // often an expanded scalar
  return a.is_cuda() ? displacement_backward_cuda(g, a, b, stats, tokens, hidden)
                     : displacement_backward_cpu(g, a, b, stats, tokens, hidden);
}

}  // namespace
}  // namespace megatron_jreg

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused per-token displacement psi = (1 - cos(a, b)) / 2 (megatron_jreg)";
  m.def("forward", &megatron_jreg::forward, "psi and the per-token backward scalars",
        pybind11::arg("a"), pybind11::arg("b"));
  m.def("backward", &megatron_jreg::backward, "gradients of psi in a and b",
        pybind11::arg("grad_psi"), pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("stats"));
  m.def("cuda_built", &megatron_jreg::cuda_built, "whether the CUDA kernel was compiled in");
  // setup.py records why a CPU-only build left CUDA out (0: CUDA was built in; 1:
  // MEGATRON_JREG_NO_CUDA was set; 2: torch was a CPU build; 3: nvcc was not found).
  m.attr("CUDA_SKIPPED") = MEGATRON_JREG_CUDA_SKIPPED;
  m.attr("EPS") = megatron_jreg::kEps;
  m.attr("NUM_STATS") = megatron_jreg::kStats;
}
