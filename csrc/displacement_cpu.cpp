// CPU kernel: OpenMP over tokens (at::parallel_for), a lane-blocked inner loop over the
// hidden dimension that the compiler vectorises, fp32 accumulation (fp64 for fp64 input).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>

#include "displacement.h"
#include "displacement_ops.h"

namespace megatron_jreg {
namespace {

// Independent partial sums per lane: the loop over lanes vectorises without -ffast-math.
// Two levels (lanes within a block of kBlock elements, then blocks) keep the fp32 rounding
// error near that of pairwise summation for hidden sizes in the thousands.
constexpr int64_t kLanes = 8;
constexpr int64_t kBlock = 256;  // a multiple of kLanes

template <typename scalar_t, typename acc_t>
inline void accumulate(const scalar_t* a, const scalar_t* b, int64_t begin, int64_t end,
                       acc_t* dot, acc_t* aa, acc_t* bb, acc_t* dd) {
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const acc_t x = static_cast<acc_t>(a[i + j]);
      const acc_t y = static_cast<acc_t>(b[i + j]);
      const acc_t d = x - y;
      dot[j] += x * y;
      aa[j] += x * x;
      bb[j] += y * y;
      dd[j] += d * d;
    }
  }
  for (int64_t j = 0; i < end; ++i, ++j) {  // tail of the last block
    const acc_t x = static_cast<acc_t>(a[i]);
    const acc_t y = static_cast<acc_t>(b[i]);
    const acc_t d = x - y;
    dot[j] += x * y;
    aa[j] += x * x;
    bb[j] += y * y;
    dd[j] += d * d;
  }
}

// out = {sum a*b, sum a*a, sum b*b, sum (a-b)^2} over one row.
template <typename scalar_t, typename acc_t>
void row_sums(const scalar_t* a, const scalar_t* b, int64_t hidden, acc_t* out) {
  acc_t dot[kLanes] = {}, aa[kLanes] = {}, bb[kLanes] = {}, dd[kLanes] = {};
  for (int64_t start = 0; start < hidden; start += kBlock) {
    acc_t bdot[kLanes] = {}, baa[kLanes] = {}, bbb[kLanes] = {}, bdd[kLanes] = {};
    accumulate<scalar_t, acc_t>(a, b, start, std::min(hidden, start + kBlock), bdot, baa, bbb, bdd);
    for (int64_t j = 0; j < kLanes; ++j) {
      dot[j] += bdot[j];
      aa[j] += baa[j];
      bb[j] += bbb[j];
      dd[j] += bdd[j];
    }
  }
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {  // pairwise across lanes
    for (int64_t j = 0; j < w; ++j) {
      dot[j] += dot[j + w];
      aa[j] += aa[j + w];
      bb[j] += bb[j + w];
      dd[j] += dd[j + w];
    }
  }
  out[0] = dot[0];
  out[1] = aa[0];
  out[2] = bb[0];
  out[3] = dd[0];
}

// Tokens per parallel chunk: about 32K elements of work, at least one token.
int64_t grain_size(int64_t hidden) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, hidden)); }

template <typename scalar_t>
void forward_kernel(const at::Tensor& a, const at::Tensor& b, at::Tensor& psi, at::Tensor& stats,
                    int64_t tokens, int64_t hidden) {
  using acc_t = at::opmath_type<scalar_t>;  // float for half/bf16/float, double for double
  const scalar_t* pa = a.const_data_ptr<scalar_t>();
  const scalar_t* pb = b.const_data_ptr<scalar_t>();
  acc_t* ppsi = psi.mutable_data_ptr<acc_t>();
  acc_t* pstats = stats.mutable_data_ptr<acc_t>();
  at::parallel_for(0, tokens, grain_size(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      acc_t sums[4];
      row_sums<scalar_t, acc_t>(pa + t * hidden, pb + t * hidden, hidden, sums);
      ppsi[t] = finish_token<acc_t>(sums[0], sums[1], sums[2], sums[3], pstats + t * kStats);
    }
  });
}

template <typename scalar_t>
void backward_kernel(const at::Tensor& grad_psi, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& stats, at::Tensor& grad_a, at::Tensor& grad_b,
                     int64_t tokens, int64_t hidden) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t* pg = grad_psi.const_data_ptr<acc_t>();
  const acc_t* pstats = stats.const_data_ptr<acc_t>();
  const scalar_t* pa = a.const_data_ptr<scalar_t>();
  const scalar_t* pb = b.const_data_ptr<scalar_t>();
  scalar_t* pga = grad_a.mutable_data_ptr<scalar_t>();
  scalar_t* pgb = grad_b.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, tokens, grain_size(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const acc_t gcos = acc_t(-0.5) * pg[t];  // dpsi/dcos = -1/2
      const acc_t* s = pstats + t * kStats;
      const acc_t inv = gcos * s[0], ka = gcos * s[1], kb = gcos * s[2];
      const scalar_t* ra = pa + t * hidden;
      const scalar_t* rb = pb + t * hidden;
      scalar_t* rga = pga + t * hidden;
      scalar_t* rgb = pgb + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const acc_t x = static_cast<acc_t>(ra[i]);
        const acc_t y = static_cast<acc_t>(rb[i]);
        rga[i] = static_cast<scalar_t>(inv * y - ka * x);
        rgb[i] = static_cast<scalar_t>(inv * x - kb * y);
      }
    }
  });
}

}  // namespace

// a, b: contiguous [tokens, hidden] CPU tensors of one dtype (checked by the bindings).
std::vector<at::Tensor> displacement_forward_cpu(const at::Tensor& a, const at::Tensor& b,
                                                 int64_t tokens, int64_t hidden) {
  const auto acc = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor psi = at::empty({tokens}, a.options().dtype(acc));
  at::Tensor stats = at::empty({tokens, kStats}, a.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(),
                                  "displacement_forward_cpu", [&] {
                                    forward_kernel<scalar_t>(a, b, psi, stats, tokens, hidden);
                                  });
  return {psi, stats};
}

// grad_psi: contiguous [tokens] in the accumulation dtype; stats from the forward.
std::vector<at::Tensor> displacement_backward_cpu(const at::Tensor& grad_psi, const at::Tensor& a,
                                                  const at::Tensor& b, const at::Tensor& stats,
                                                  int64_t tokens, int64_t hidden) {
  at::Tensor grad_a = at::empty_like(a);
  at::Tensor grad_b = at::empty_like(b);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(),
                                  "displacement_backward_cpu", [&] {
                                    backward_kernel<scalar_t>(grad_psi, a, b, stats, grad_a,
                                                              grad_b, tokens, hidden);
                                  });
  return {grad_a, grad_b};
}

}  // namespace megatron_jreg
