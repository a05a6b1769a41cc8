// ATen-level entry points of the displacement kernels, called by the bindings.
// Inputs are already checked and flattened: a, b contiguous [tokens, hidden], same dtype
// and device; grad_psi contiguous [tokens] and stats [tokens, 3] in the accumulation dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace megatron_jreg {

// Returns {psi [tokens], stats [tokens, 3]}.
std::vector<at::Tensor> displacement_forward_cpu(const at::Tensor& a, const at::Tensor& b,
                                                 int64_t tokens, int64_t hidden);
// Returns {grad_a, grad_b}, each like a.
std::vector<at::Tensor> displacement_backward_cpu(const at::Tensor& grad_psi, const at::Tensor& a,
                                                  const at::Tensor& b, const at::Tensor& stats,
                                                  int64_t tokens, int64_t hidden);

// CUDA tensors (displacement_cuda_glue.cpp); raise when the extension was built without CUDA.
bool cuda_built();
std::vector<at::Tensor> displacement_forward_cuda(const at::Tensor& a, const at::Tensor& b,
                                                  int64_t tokens, int64_t hidden);
std::vector<at::Tensor> displacement_backward_cuda(const at::Tensor& grad_psi,
                                                   const at::Tensor& a, const at::Tensor& b,
                                                   const at::Tensor& stats, int64_t tokens,
                                                   int64_t hidden);

}  // namespace megatron_jreg
