// Per-token displacement psi = (1 - cos(a, b)) / 2 over the last dimension.
//
// Shared by the CPU kernel, the CUDA kernel and the bindings. The four sums are taken in
// fp64 for every input dtype (a product of two fp32, bf16 or fp16 values is exact in fp64,
// and the sums' rounding stays near 1e-16), so psi is accurate to ~1e-7 relative down to
// psi ~ 1e-9 (nearly parallel a and b), where fp32 sums lose every digit:
//
//   dot = sum a*b, aa = sum a*a, bb = sum b*b, dd = sum (a-b)^2      (one read of a, b)
//   p = aa*bb;  degenerate = p < eps^2 (megatron_jreg.jreg.token_displacement_reference)
//   otherwise:    1 - c = (dd - (|a|-|b|)^2) / (2|a||b|),  |a|-|b| = (aa-bb)/(|a|+|b|)
//                 where dd < |a||b|/2 (a, b close: no cancellation, unlike 1 - dot/(|a||b|)),
//                 else 1 - c = 1 - dot/(|a||b|) as the reference
//   degenerate (p < eps^2): c = dot / eps, held constant (zero vectors give psi = 0.5)
//
// psi and the saved scalars are stored in the accumulation type acc (fp32 for
// fp16/bf16/fp32 inputs, fp64 for fp64); the backward computes in acc.
//
// Saved for backward, per token: inv = 1/(|a||b|), ka = c/aa, kb = c/bb (all 0 for a
// degenerate token, whose gradient is 0 as in the reference), so that
//
//   dpsi/da = -(inv*b - ka*a)/2,   dpsi/db = -(inv*a - kb*b)/2       (one read, one write)
//
// A token whose upstream gradient is exactly 0 (masked out of the mean) gets exactly 0
// gradient without reading a or b: a NaN or inf in a masked token never reaches the model.
#pragma once

#include <cmath>
#include <cstdint>

namespace megatron_jreg {

// Same floor as megatron_jreg.jreg.EPS; the bindings export it and a test checks they agree.
constexpr double kEps = 1e-8;
constexpr int kStats = 3;  // inv, ka, kb

#if defined(__CUDACC__)
#define JREG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JREG_HOST_DEVICE inline
#endif

// From the four sums to psi and the three backward scalars. Same code on CPU and GPU.
template <typename acc_t>
JREG_HOST_DEVICE acc_t finish_token(acc_t dot, acc_t aa, acc_t bb, acc_t dd, acc_t* stats) {
  using std::sqrt;  // the float overload for float, on host and device
  const acc_t eps = static_cast<acc_t>(kEps);
  const acc_t p = aa * bb;
  if (p >= eps * eps) {
    const acc_t root = sqrt(p);
    const acc_t na = sqrt(aa);
    const acc_t nb = sqrt(bb);
    // Rounding error of the difference form ~ 4 eps * (1 - c), of the plain form ~ eps:
    // the difference form where 1 - c < ~1/4 (close vectors, e.g. middle layers at c > 0.95).
    acc_t one_minus_c;
    if (dd < acc_t(0.5) * na * nb) {
      const acc_t radial = (aa - bb) / (na + nb);  // |a| - |b|
      one_minus_c = (dd - radial * radial) / (acc_t(2) * na * nb);
    } else {
      one_minus_c = acc_t(1) - dot / root;
    }
    const acc_t c = acc_t(1) - one_minus_c;
    stats[0] = acc_t(1) / root;
    stats[1] = c / aa;
    stats[2] = c / bb;
    return acc_t(0.5) * one_minus_c;
  }
  // Degenerate token (|a||b| < eps): c = dot/eps is held constant, as in the reference:
  // it has no direction to move, so its gradient is 0 (never NaN or 1/eps).
  const acc_t c = dot / eps;
  stats[0] = acc_t(0);
  stats[1] = acc_t(0);
  stats[2] = acc_t(0);
  return acc_t(0.5) * (acc_t(1) - c);
}

// Dtype codes shared between the ATen glue and the CUDA translation unit, which includes
// no torch header (the CPU build of torch ships c10/cuda headers that need generated files).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// CUDA launchers (displacement_cuda.cu). Pointers are device pointers to contiguous
// [tokens, hidden] inputs; psi and stats are in the accumulation type (fp64 for kFloat64,
// fp32 otherwise). stream is a cudaStream_t. Return a cudaError_t (0 = success).
int launch_displacement_forward_cuda(DType dtype, const void* a, const void* b, void* psi,
                                     void* stats, int64_t tokens, int64_t hidden, void* stream);
int launch_displacement_backward_cuda(DType dtype, const void* grad_psi, const void* a,
                                      const void* b, const void* stats, void* grad_a,
                                      void* grad_b, int64_t tokens, int64_t hidden,
                                      void* stream);
const char* cuda_error_string(int code);

}  // namespace megatron_jreg
