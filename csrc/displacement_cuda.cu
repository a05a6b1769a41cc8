// CUDA kernel: one warp per token, 16-byte vectorised loads and stores where the rows are
// aligned, warp-shuffle reduction. The forward's sums are fp64 for every input dtype (see
// displacement.h: the kernel is bound by memory, not by fp64 arithmetic, on data-centre
// GPUs); the backward computes in fp32 (fp64 for fp64 input).
//
// This translation unit includes no torch header on purpose: the CPU build of torch ships
// c10/cuda headers that need files generated only for CUDA builds, and keeping the kernel
// free of them lets CI compile it with plain nvcc (tests/ops/test_displacement_cuda_compile.py).
// The ATen glue (allocation, stream, device guard) is displacement_cuda_glue.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "displacement.h"

namespace megatron_jreg {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // 8 tokens per block
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this

// Conversions spelled out: torch builds with __CUDA_NO_HALF_CONVERSIONS__ and friends.
template <typename T> struct Convert;
template <> struct Convert<float> {
  using acc_t = float;
  static __device__ __forceinline__ float to_acc(float x) { return x; }
  static __device__ __forceinline__ float from_acc(float x) { return x; }
};
template <> struct Convert<double> {
  using acc_t = double;
  static __device__ __forceinline__ double to_acc(double x) { return x; }
  static __device__ __forceinline__ double from_acc(double x) { return x; }
};
template <> struct Convert<__half> {
  using acc_t = float;
  static __device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_acc(float x) { return __float2half_rn(x); }
};
template <> struct Convert<__nv_bfloat16> {
  using acc_t = float;
  static __device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_acc(float x) { return __float2bfloat16_rn(x); }
};

// 16 bytes of T: one ld.global.v4 / st.global.v4.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads) forward_kernel(
    const T* __restrict__ a, const T* __restrict__ b, typename Convert<T>::acc_t* __restrict__ psi,
    typename Convert<T>::acc_t* __restrict__ stats, int64_t tokens, int64_t hidden) {
  using C = Convert<T>;
  using acc_t = typename C::acc_t;
  constexpr int kVec = Pack<T>::kSize;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / kWarp);
  for (int64_t t = int64_t(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp; t < tokens;
       t += warps) {
    const T* ra = a + t * hidden;
    const T* rb = b + t * hidden;
    double dot = 0, aa = 0, bb = 0, dd = 0;
    if (kVectorized) {
#pragma unroll 2
      for (int64_t i = int64_t(lane) * kVec; i < hidden; i += kWarp * kVec) {
        const Pack<T> pa = *reinterpret_cast<const Pack<T>*>(ra + i);
        const Pack<T> pb = *reinterpret_cast<const Pack<T>*>(rb + i);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const double x = C::to_acc(pa.v[j]), y = C::to_acc(pb.v[j]), d = x - y;
          dot += x * y;
          aa += x * x;
          bb += y * y;
          dd += d * d;
        }
      }
    } else {
      for (int64_t i = lane; i < hidden; i += kWarp) {
        const double x = C::to_acc(ra[i]), y = C::to_acc(rb[i]), d = x - y;
        dot += x * y;
        aa += x * x;
        bb += y * y;
        dd += d * d;
      }
    }
    dot = warp_sum(dot);
    aa = warp_sum(aa);
    bb = warp_sum(bb);
    dd = warp_sum(dd);
    if (lane == 0) {
      double s[kStats];
      psi[t] = static_cast<acc_t>(finish_token<double>(dot, aa, bb, dd, s));
      for (int k = 0; k < kStats; ++k) stats[t * kStats + k] = static_cast<acc_t>(s[k]);
    }
  }
}

template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads) backward_kernel(
    const typename Convert<T>::acc_t* __restrict__ grad_psi, const T* __restrict__ a,
    const T* __restrict__ b, const typename Convert<T>::acc_t* __restrict__ stats,
    T* __restrict__ grad_a, T* __restrict__ grad_b, int64_t tokens, int64_t hidden) {
  using C = Convert<T>;
  using acc_t = typename C::acc_t;
  constexpr int kVec = Pack<T>::kSize;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / kWarp);
  for (int64_t t = int64_t(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp; t < tokens;
       t += warps) {
    const acc_t g = grad_psi[t];
    const int64_t row = t * hidden;
    if (g == acc_t(0)) {  // a masked-out token: exactly 0, whatever a and b hold (warp-uniform)
      const T zero = C::from_acc(acc_t(0));
      for (int64_t i = lane; i < hidden; i += kWarp) {
        grad_a[row + i] = zero;
        grad_b[row + i] = zero;
      }
      continue;
    }
    const acc_t gcos = acc_t(-0.5) * g;  // dpsi/dcos = -1/2
    const acc_t inv = gcos * stats[t * kStats + 0];
    const acc_t ka = gcos * stats[t * kStats + 1];
    const acc_t kb = gcos * stats[t * kStats + 2];
    if (kVectorized) {
#pragma unroll 2
      for (int64_t i = int64_t(lane) * kVec; i < hidden; i += kWarp * kVec) {
        const Pack<T> pa = *reinterpret_cast<const Pack<T>*>(a + row + i);
        const Pack<T> pb = *reinterpret_cast<const Pack<T>*>(b + row + i);
        Pack<T> ga, gb;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const acc_t x = C::to_acc(pa.v[j]), y = C::to_acc(pb.v[j]);
          ga.v[j] = C::from_acc(inv * y - ka * x);
          gb.v[j] = C::from_acc(inv * x - kb * y);
        }
        *reinterpret_cast<Pack<T>*>(grad_a + row + i) = ga;
        *reinterpret_cast<Pack<T>*>(grad_b + row + i) = gb;
      }
    } else {
      for (int64_t i = lane; i < hidden; i += kWarp) {
        const acc_t x = C::to_acc(a[row + i]), y = C::to_acc(b[row + i]);
        grad_a[row + i] = C::from_acc(inv * y - ka * x);
        grad_b[row + i] = C::from_acc(inv * x - kb * y);
      }
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Rows start on 16-byte boundaries when the base is aligned and a row is a whole number of packs.
template <typename T>
bool can_vectorize(int64_t hidden, const void* p0, const void* p1, const void* p2 = nullptr,
                   const void* p3 = nullptr) {
  return hidden % Pack<T>::kSize == 0 && aligned16(p0) && aligned16(p1) &&
         (p2 == nullptr || aligned16(p2)) && (p3 == nullptr || aligned16(p3));
}

unsigned int blocks_for(int64_t tokens) {
  const int64_t per_block = kThreads / kWarp;
  int64_t blocks = (tokens + per_block - 1) / per_block;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned int>(blocks < 1 ? 1 : blocks);
}

template <typename T>
int forward(const void* a, const void* b, void* psi, void* stats, int64_t tokens, int64_t hidden,
            cudaStream_t stream) {
  using acc_t = typename Convert<T>::acc_t;
  if (tokens == 0) return cudaSuccess;
  const auto* pa = static_cast<const T*>(a);
  const auto* pb = static_cast<const T*>(b);
  auto* ppsi = static_cast<acc_t*>(psi);
  auto* pstats = static_cast<acc_t*>(stats);
  if (can_vectorize<T>(hidden, a, b)) {
    forward_kernel<T, true><<<blocks_for(tokens), kThreads, 0, stream>>>(pa, pb, ppsi, pstats, tokens, hidden);
  } else {
    forward_kernel<T, false><<<blocks_for(tokens), kThreads, 0, stream>>>(pa, pb, ppsi, pstats, tokens, hidden);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int backward(const void* grad_psi, const void* a, const void* b, const void* stats, void* grad_a,
             void* grad_b, int64_t tokens, int64_t hidden, cudaStream_t stream) {
  using acc_t = typename Convert<T>::acc_t;
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  const auto* pg = static_cast<const acc_t*>(grad_psi);
  const auto* pa = static_cast<const T*>(a);
  const auto* pb = static_cast<const T*>(b);
  const auto* ps = static_cast<const acc_t*>(stats);
  auto* pga = static_cast<T*>(grad_a);
  auto* pgb = static_cast<T*>(grad_b);
  if (can_vectorize<T>(hidden, a, b, grad_a, grad_b)) {
    backward_kernel<T, true><<<blocks_for(tokens), kThreads, 0, stream>>>(pg, pa, pb, ps, pga, pgb, tokens, hidden);
  } else {
    backward_kernel<T, false><<<blocks_for(tokens), kThreads, 0, stream>>>(pg, pa, pb, ps, pga, pgb, tokens, hidden);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_displacement_forward_cuda(DType dtype, const void* a, const void* b, void* psi,
                                     void* stats, int64_t tokens, int64_t hidden, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return forward<float>(a, b, psi, stats, tokens, hidden, s);
    case DType::kFloat16: return forward<__half>(a, b, psi, stats, tokens, hidden, s);
    case DType::kBFloat16: return forward<__nv_bfloat16>(a, b, psi, stats, tokens, hidden, s);
    case DType::kFloat64: return forward<double>(a, b, psi, stats, tokens, hidden, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_displacement_backward_cuda(DType dtype, const void* grad_psi, const void* a,
                                      const void* b, const void* stats, void* grad_a,
                                      void* grad_b, int64_t tokens, int64_t hidden,
                                      void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: return backward<float>(grad_psi, a, b, stats, grad_a, grad_b, tokens, hidden, s);
    case DType::kFloat16: return backward<__half>(grad_psi, a, b, stats, grad_a, grad_b, tokens, hidden, s);
    case DType::kBFloat16: return backward<__nv_bfloat16>(grad_psi, a, b, stats, grad_a, grad_b, tokens, hidden, s);
    case DType::kFloat64: return backward<double>(grad_psi, a, b, stats, grad_a, grad_b, tokens, hidden, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace megatron_jreg
