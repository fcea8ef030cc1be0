// Fused log-prob gather on CUDA: one block per row, warp-shuffle reductions.
//
// Forward: each thread keeps an online (max, Σexp) pair over a strided slice of its row; pairs
// are merged across the warp with shuffles and across warps through shared memory; thread 0
// writes lse (float64) and ℓ = x[y] − lse. Backward: g·(onehot − exp(x − lse)) element-wise,
// each element read and written by the same thread, so it can run in place (chunked path).
// float32 / bf16 / fp16 accumulate in float32, float64 in float64. An out-of-range target gives
// NaN (checking it on the host would need a device sync).

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "../chunked.h"
#include "../gyre_ops.h"

namespace gyre {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float dexp(float x) { return expf(x); }
__device__ __forceinline__ double dexp(double x) { return exp(x); }

template <typename A>
struct MaxSum {
  A m;
  A s;
};

template <typename A>
__device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  const A m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) return {m, A(0)};
  return {m, a.s * dexp(a.m - m) + b.s * dexp(b.m - m)};
}

// Reduces over the block; the result is valid in thread 0.
template <typename A>
__device__ MaxSum<A> block_merge(MaxSum<A> v) {
  __shared__ A sm[32];
  __shared__ A ss[32];
  for (int off = 16; off > 0; off >>= 1) {
    MaxSum<A> o{__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
    v = merge(v, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    v = lane < nwarps ? MaxSum<A>{sm[lane], ss[lane]} : MaxSum<A>{A(-INFINITY), A(0)};
    for (int off = 16; off > 0; off >>= 1) {
      MaxSum<A> o{__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
      v = merge(v, o);
    }
  }
  return v;
}

template <typename T, typename A>
__global__ void logprobs_fwd_kernel(const T* __restrict__ x, const int64_t* __restrict__ y, int64_t V,
                                    A* __restrict__ out, double* __restrict__ lse) {
  const int64_t row = blockIdx.x;
  const T* r = x + row * V;
  MaxSum<A> acc{A(-INFINITY), A(0)};
  for (int64_t k = threadIdx.x; k < V; k += blockDim.x) {
    const A v = static_cast<A>(r[k]);
    if (v > acc.m) {
      acc.s = acc.s * dexp(acc.m - v) + A(1);
      acc.m = v;
    } else if (v != -INFINITY) {
      acc.s += dexp(v - acc.m);
    }
  }
  acc = block_merge(acc);
  if (threadIdx.x == 0) {
    const double l = static_cast<double>(acc.m) + log(static_cast<double>(acc.s));
    const int64_t t = y[row];
    lse[row] = l;
    out[row] = (t >= 0 && t < V) ? static_cast<A>(static_cast<double>(static_cast<A>(r[t])) - l) : A(NAN);
  }
}

template <typename T, typename A>
__global__ void logprobs_bwd_kernel(const A* __restrict__ g, const T* x, const int64_t* __restrict__ y,
                                    const double* __restrict__ lse, int64_t V, T* out) {
  const int64_t row = blockIdx.x;
  const T* r = x + row * V;
  T* o = out + row * V;
  const A gg = g[row];
  const double l = lse[row];
  const A m = static_cast<A>(l);
  const A rest = static_cast<A>(l - static_cast<double>(m));  // lse = m + rest, kept for fp32 accuracy
  const int64_t t = y[row];
  for (int64_t k = threadIdx.x; k < V; k += blockDim.x) {
    const A p = dexp((static_cast<A>(r[k]) - m) - rest);
    A val = -gg * p;
    if (k == t) val += gg;
    o[k] = static_cast<T>(val);
  }
}

}  // namespace

void logprobs_fwd_into_cuda(const at::Tensor& logits, const at::Tensor& targets, at::Tensor& out, at::Tensor& lse) {
  check_logits_targets(logits, targets, "gyre::logprobs_fwd");
  TORCH_CHECK(logits.is_contiguous() && targets.is_contiguous() && out.is_contiguous() && lse.is_contiguous(),
              "gyre::logprobs_fwd: tensors must be contiguous");
  const int64_t T = logits.size(0), V = logits.size(1);
  if (T == 0) return;
  c10::cuda::CUDAGuard guard(logits.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "gyre_logprobs_fwd_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    logprobs_fwd_kernel<scalar_t, A><<<T, kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), V, out.data_ptr<A>(), lse.data_ptr<double>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void logprobs_bwd_into_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                            const at::Tensor& lse, at::Tensor& grad_logits) {
  check_logits_targets(logits, targets, "gyre::logprobs_bwd");
  const int64_t T = logits.size(0), V = logits.size(1);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == T, "gyre::logprobs_bwd: grad must be [T]");
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == T && lse.scalar_type() == at::kDouble,
              "gyre::logprobs_bwd: lse must be [T] float64");
  TORCH_CHECK(logits.is_contiguous() && grad_logits.is_contiguous(), "gyre::logprobs_bwd: logits must be contiguous");
  if (T == 0) return;
  c10::cuda::CUDAGuard guard(logits.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto lse_c = lse.contiguous();
  auto tg = targets.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "gyre_logprobs_bwd_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    auto g = grad.to(c10::CppTypeToScalarType<A>::value).contiguous();
    logprobs_bwd_kernel<scalar_t, A><<<T, kThreads, 0, stream>>>(g.data_ptr<A>(), logits.data_ptr<scalar_t>(),
                                                                 tg.data_ptr<int64_t>(), lse_c.data_ptr<double>(), V,
                                                                 grad_logits.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

namespace {

std::tuple<at::Tensor, at::Tensor> logprobs_fwd_cuda(const at::Tensor& logits, const at::Tensor& targets) {
  check_logits_targets(logits, targets, "gyre::logprobs_fwd");
  auto x = logits.contiguous();
  auto out = at::empty({x.size(0)}, x.options().dtype(logprob_out_dtype(x.scalar_type())));
  auto lse = at::empty({x.size(0)}, x.options().dtype(at::kDouble));
  logprobs_fwd_into_cuda(x, targets.contiguous(), out, lse);
  return {out, lse};
}

at::Tensor logprobs_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                             const at::Tensor& lse) {
  auto x = logits.contiguous();
  auto gl = at::empty_like(x, at::MemoryFormat::Contiguous);
  logprobs_bwd_into_cuda(grad, x, targets.contiguous(), lse, gl);
  return gl;
}

std::tuple<at::Tensor, at::Tensor> logprobs_hidden_fwd_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                            const at::Tensor& targets, int64_t chunk) {
  return chunked_fwd(hidden.contiguous(), weight.contiguous(), targets.contiguous(), chunk, logprobs_fwd_into_cuda);
}

std::tuple<at::Tensor, at::Tensor> logprobs_hidden_bwd_cuda(const at::Tensor& grad, const at::Tensor& hidden,
                                                            const at::Tensor& weight, const at::Tensor& targets,
                                                            const at::Tensor& lse, int64_t chunk) {
  return chunked_bwd(grad.contiguous(), hidden.contiguous(), weight.contiguous(), targets.contiguous(), lse, chunk,
                     logprobs_bwd_into_cuda);
}

}  // namespace
}  // namespace gyre

TORCH_LIBRARY_IMPL(gyre, CUDA, m) {
  m.impl("logprobs_fwd", &gyre::logprobs_fwd_cuda);
  m.impl("logprobs_bwd", &gyre::logprobs_bwd_cuda);
  m.impl("logprobs_hidden_fwd", &gyre::logprobs_hidden_fwd_cuda);
  m.impl("logprobs_hidden_bwd", &gyre::logprobs_hidden_bwd_cuda);
}
