// CPU kernel: OpenMP over tokens (at::parallel_for, torch's thread count), SIMD over the
// hidden dimension in both passes (bf16 converted in vector registers). The forward's four
// sums are fp64 for every input dtype (see displacement.h); the backward is fp32 (fp64 for
// fp64 input).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "displacement.h"
#include "displacement_ops.h"

// No FMA contraction: a*b - c*d is then rounded the same way in every clone (AVX-512 has
// scalar FMA, the default build none), so results do not depend on the machine.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace megatron_jreg {
namespace {

// Both passes work in 32-byte SIMD vectors (GCC/Clang vector extensions: 8 fp32 or 4 fp64
// lanes), which stay in registers; on x86-64 the row functions are also cloned for
// AVX2/AVX-512 and picked at load time, so one build runs everywhere. Two levels of partial
// sums (lanes within a block of kBlock elements, then blocks) keep the rounding error near
// pairwise summation.
constexpr int64_t kBlock = 256;

template <typename acc_t>
struct Simd {
  using type [[gnu::vector_size(32)]] = acc_t;
  static constexpr int64_t kLanes = 32 / sizeof(acc_t);
};
using U16x8 [[gnu::vector_size(16)]] = uint16_t;  // bf16 bits, one per fp32 lane
using U32x8 [[gnu::vector_size(32)]] = uint32_t;  // the fp32 bits
using U16x4 [[gnu::vector_size(8)]] = uint16_t;   // bf16 bits, one per fp64 lane
using U32x4 [[gnu::vector_size(16)]] = uint32_t;
using F32x4 [[gnu::vector_size(16)]] = float;

// kLanes elements of p as a vector of acc_t. GCC turns the loop into vector widening
// (bf16: one zero-extend and a shift per vector); to fp64 (the forward's sums) fp32 and
// bf16 widen in vector registers too: bf16 bits << 16 are the fp32 bits, fp32 to fp64 is
// one conversion (both exact).
template <typename scalar_t, typename acc_t>
[[gnu::always_inline]] inline typename Simd<acc_t>::type load(const scalar_t* p) {
  using S = Simd<acc_t>;
  typename S::type v;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<acc_t, double> && std::is_same_v<scalar_t, float>) {
    F32x4 f;
    std::memcpy(&f, p, sizeof(f));
    v = __builtin_convertvector(f, typename S::type);
  } else if constexpr (std::is_same_v<acc_t, double> && std::is_same_v<scalar_t, c10::BFloat16>) {
    U16x4 bits;
    std::memcpy(&bits, p, sizeof(bits));
    const U32x4 wide = __builtin_convertvector(bits, U32x4) << 16;
    F32x4 f;
    std::memcpy(&f, &wide, sizeof(f));
    v = __builtin_convertvector(f, typename S::type);
  } else {
    acc_t tmp[S::kLanes];
    for (int64_t j = 0; j < S::kLanes; ++j) tmp[j] = static_cast<acc_t>(p[j]);
    std::memcpy(&v, tmp, sizeof(v));
  }
  return v;
}

// Writes a vector of acc_t to kLanes elements of p. bf16 rounds to nearest even with NaN
// to 0x7FC0, bit for bit c10::BFloat16(float), in vector registers: c10's scalar
// conversion (a branch on NaN) kept the loop scalar, slower than fp32 at half the bytes.
template <typename scalar_t, typename acc_t>
[[gnu::always_inline]] inline void store(scalar_t* p, typename Simd<acc_t>::type v) {
  using S = Simd<acc_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    static_assert(std::is_same_v<acc_t, float>);
    U32x8 bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const U32x8 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
    const U32x8 is_nan = (U32x8)(v != v);  // all ones where NaN; a select GCC and Clang both take
    const U32x8 out = (rounded & ~is_nan) | (0x7FC0u & is_nan);
    const U16x8 narrow = __builtin_convertvector(out, U16x8);
    std::memcpy(p, &narrow, sizeof(narrow));
  } else {
    acc_t tmp[S::kLanes];
    std::memcpy(tmp, &v, sizeof(v));
    for (int64_t j = 0; j < S::kLanes; ++j) p[j] = static_cast<scalar_t>(tmp[j]);
  }
}

template <typename acc_t>
[[gnu::always_inline]] inline acc_t horizontal_sum(typename Simd<acc_t>::type v) {
  acc_t lanes[Simd<acc_t>::kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  for (int64_t w = Simd<acc_t>::kLanes / 2; w > 0; w /= 2) {
    for (int64_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  }
  return lanes[0];
}

// out = {sum a*b, sum a*a, sum b*b, sum (a-b)^2} over one row.
template <typename scalar_t, typename acc_t>
[[gnu::always_inline]] inline void row_sums_impl(const scalar_t* a, const scalar_t* b, int64_t hidden, acc_t* out) {
  using V = typename Simd<acc_t>::type;
  constexpr int64_t kLanes = Simd<acc_t>::kLanes;
  V dot = {}, aa = {}, bb = {}, dd = {};
  const int64_t body = hidden - hidden % kLanes;
  for (int64_t start = 0; start < body; start += kBlock) {
    const int64_t stop = std::min(body, start + kBlock);
    V bdot = {}, baa = {}, bbb = {}, bdd = {};
    for (int64_t i = start; i < stop; i += kLanes) {
      const V x = load<scalar_t, acc_t>(a + i);
      const V y = load<scalar_t, acc_t>(b + i);
      const V d = x - y;
      bdot += x * y;
      baa += x * x;
      bbb += y * y;
      bdd += d * d;
    }
    dot += bdot;
    aa += baa;
    bb += bbb;
    dd += bdd;
  }
  acc_t sdot = horizontal_sum<acc_t>(dot), saa = horizontal_sum<acc_t>(aa);
  acc_t sbb = horizontal_sum<acc_t>(bb), sdd = horizontal_sum<acc_t>(dd);
  for (int64_t i = body; i < hidden; ++i) {  // the last hidden % kLanes elements
    const acc_t x = static_cast<acc_t>(a[i]);
    const acc_t y = static_cast<acc_t>(b[i]);
    const acc_t d = x - y;
    sdot += x * y;
    saa += x * x;
    sbb += y * y;
    sdd += d * d;
  }
  out[0] = sdot;
  out[1] = saa;
  out[2] = sbb;
  out[3] = sdd;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JREG_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define JREG_CPU_CLONES
#endif

// One row of the backward: ga = inv*b - ka*a, gb = inv*a - kb*b (inv, ka, kb already carry
// the upstream gradient). Two products then a difference, in every clone and the tail.
template <typename scalar_t, typename acc_t>
[[gnu::always_inline]] inline void grad_row_impl(const scalar_t* a, const scalar_t* b, acc_t inv, acc_t ka,
                                                 acc_t kb, scalar_t* ga, scalar_t* gb, int64_t hidden) {
  using V = typename Simd<acc_t>::type;
  constexpr int64_t kLanes = Simd<acc_t>::kLanes;
  const V vinv = V{} + inv, vka = V{} + ka, vkb = V{} + kb;
  const int64_t body = hidden - hidden % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    const V x = load<scalar_t, acc_t>(a + i);
    const V y = load<scalar_t, acc_t>(b + i);
    store<scalar_t, acc_t>(ga + i, vinv * y - vka * x);
    store<scalar_t, acc_t>(gb + i, vinv * x - vkb * y);
  }
  for (int64_t i = body; i < hidden; ++i) {
    const acc_t x = static_cast<acc_t>(a[i]);
    const acc_t y = static_cast<acc_t>(b[i]);
    ga[i] = static_cast<scalar_t>(inv * y - ka * x);
    gb[i] = static_cast<scalar_t>(inv * x - kb * y);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JREG_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define JREG_CPU_CLONES
#endif

// One non-template function per input dtype: function multiversioning needs plain functions.
// The sums are fp64 for every input (a product of two fp32 values is exact in fp64).
#define JREG_ROW_FUNCTIONS(scalar_t, acc_t)                                                \
  JREG_CPU_CLONES void row_sums(const scalar_t* a, const scalar_t* b, int64_t hidden,      \
                                double* out) {                                             \
    row_sums_impl<scalar_t, double>(a, b, hidden, out);                                    \
  }                                                                                        \
  JREG_CPU_CLONES void grad_row(const scalar_t* a, const scalar_t* b, acc_t inv, acc_t ka, \
                                acc_t kb, scalar_t* ga, scalar_t* gb, int64_t hidden) {    \
    grad_row_impl<scalar_t, acc_t>(a, b, inv, ka, kb, ga, gb, hidden);                     \
  }
JREG_ROW_FUNCTIONS(float, float)
JREG_ROW_FUNCTIONS(double, double)
JREG_ROW_FUNCTIONS(c10::BFloat16, float)
JREG_ROW_FUNCTIONS(c10::Half, float)
#undef JREG_ROW_FUNCTIONS

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
      double sums[4], stats[kStats];
      row_sums(pa + t * hidden, pb + t * hidden, hidden, sums);
      ppsi[t] = static_cast<acc_t>(finish_token<double>(sums[0], sums[1], sums[2], sums[3], stats));
      for (int k = 0; k < kStats; ++k) pstats[t * kStats + k] = static_cast<acc_t>(stats[k]);
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
      scalar_t* rga = pga + t * hidden;
      scalar_t* rgb = pgb + t * hidden;
      if (pg[t] == acc_t(0)) {  // a masked-out token: exactly 0, whatever a and b hold
        std::fill(rga, rga + hidden, scalar_t(0));
        std::fill(rgb, rgb + hidden, scalar_t(0));
        continue;
      }
      const acc_t gcos = acc_t(-0.5) * pg[t];  // dpsi/dcos = -1/2
      const acc_t* s = pstats + t * kStats;
      const acc_t inv = gcos * s[0], ka = gcos * s[1], kb = gcos * s[2];
      grad_row(pa + t * hidden, pb + t * hidden, inv, ka, kb, rga, rgb, hidden);
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
