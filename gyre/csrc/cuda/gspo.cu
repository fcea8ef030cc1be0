// Packed execution-level GSPO loss on CUDA (DESIGN §6); same math as gspo_cpu.cpp.
//
// Three small kernels, all float64: (1) per-token segment sums Σδ and counts per execution
// (atomicAdd), (2) one thread per execution for s_i and the gate m_i, (3) per-token coeff_t =
// m_i·ω_t·token_weight_t with a block reduction of (loss, targets, ω capped, Σ|δ|) and one
// atomicAdd per block. Validation that needs the data (exec_index range, L_i > 0) is done with
// ATen reductions on the device, one host sync per call.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "../gyre_ops.h"

namespace gyre {
namespace {

constexpr int kThreads = 256;

__global__ void segment_sums_kernel(const double* __restrict__ lp, const double* __restrict__ b,
                                    const bool* __restrict__ mask, const int64_t* __restrict__ idx, int64_t n,
                                    double* __restrict__ sums, unsigned long long* __restrict__ count) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n || !mask[t]) return;
  if (sums) atomicAdd(sums + idx[t], lp[t] - b[t]);
  atomicAdd(count + idx[t], 1ull);
}

__global__ void gate_kernel(const double* __restrict__ sums, const double* __restrict__ adv,
                            const int64_t* __restrict__ len, int64_t E, double eps_low, double eps_high,
                            double* __restrict__ ratio, double* __restrict__ gate) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= E) return;
  const double L = static_cast<double>(len[i] > 0 ? len[i] : 1);
  const double s = exp(sums[i] / L);
  ratio[i] = s;
  const bool clipped = (adv[i] > 0 && s > 1.0 + eps_high) || (adv[i] < 0 && s < 1.0 - eps_low);
  gate[i] = clipped ? 0.0 : 1.0;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__global__ void token_kernel(const double* __restrict__ lp, const double* __restrict__ b,
                             const bool* __restrict__ mask, const int64_t* __restrict__ idx,
                             const double* __restrict__ w, const double* __restrict__ gate, int64_t n, double cap,
                             double* __restrict__ coeff, double* __restrict__ acc) {
  __shared__ double sh[4][32];
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  double v[4] = {0.0, 0.0, 0.0, 0.0};  // loss, targets, ω capped, Σ|δ|
  if (t < n) {
    double c = 0.0;
    if (mask[t]) {
      const double d = lp[t] - b[t];
      const double e = exp(d);
      c = gate[idx[t]] * fmin(e, cap) * w[t];
      v[0] = c * lp[t];
      v[1] = 1.0;
      v[2] = e > cap ? 1.0 : 0.0;
      v[3] = fabs(d);
    }
    coeff[t] = c;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k = 0; k < 4; ++k) {
    v[k] = warp_sum(v[k]);
    if (lane == 0) sh[k][warp] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    for (int k = 0; k < 4; ++k) {
      double x = lane < nwarps ? sh[k][lane] : 0.0;
      x = warp_sum(x);
      if (lane == 0) atomicAdd(acc + k, x);
    }
  }
}

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

void check_index_range(const at::Tensor& mask, const at::Tensor& idx, int64_t E) {
  const bool bad = at::logical_and(mask, at::logical_or(idx < 0, idx >= E)).any().item<bool>();
  TORCH_CHECK(!bad, "gyre: exec_index out of range [0, ", E, ") on a target position");
}

at::Tensor exec_logratio_sums_cuda(const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask,
                                   const at::Tensor& exec_index, int64_t num_exec) {
  check_packed(logprobs, behavior, mask, exec_index, nullptr, num_exec);
  c10::cuda::CUDAGuard guard(logprobs.device());
  auto lp = logprobs.to(at::kDouble).contiguous();
  auto b = behavior.to(logprobs.device(), at::kDouble).contiguous();
  auto m = mask.contiguous();
  auto ix = exec_index.contiguous();
  check_index_range(m, ix, num_exec);
  auto sums = at::zeros({num_exec}, lp.options());
  auto count = at::zeros({num_exec}, lp.options().dtype(at::kLong));
  const int64_t n = lp.numel();
  if (n > 0) {
    segment_sums_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        lp.data_ptr<double>(), b.data_ptr<double>(), m.data_ptr<bool>(), ix.data_ptr<int64_t>(), n,
        sums.data_ptr<double>(), reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return sums;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gspo_loss_fwd_cuda(
    const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask, const at::Tensor& exec_index,
    const at::Tensor& token_weight, const at::Tensor& advantages, const at::Tensor& exec_lengths,
    const c10::optional<at::Tensor>& exec_logratio_sum, double eps_low, double eps_high, double cap) {
  const int64_t E = advantages.numel();
  check_packed(logprobs, behavior, mask, exec_index, &token_weight, E);
  TORCH_CHECK(advantages.dim() == 1 && exec_lengths.sizes() == advantages.sizes(),
              "gyre::gspo_loss: advantages and exec_lengths must both be [E]");
  TORCH_CHECK(cap > 0 && eps_low >= 0 && eps_high >= 0, "gyre::gspo_loss: need cap > 0, eps >= 0");
  c10::cuda::CUDAGuard guard(logprobs.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto dev = logprobs.device();
  auto lp = logprobs.to(at::kDouble).contiguous();
  auto b = behavior.to(dev, at::kDouble).contiguous();
  auto m = mask.to(dev).contiguous();
  auto ix = exec_index.to(dev).contiguous();
  auto tw = token_weight.to(dev, at::kDouble).contiguous();
  auto adv = advantages.to(dev, at::kDouble).contiguous();
  auto len = exec_lengths.to(dev, at::kLong).contiguous();
  check_index_range(m, ix, E);
  const int64_t n = lp.numel();
  auto opts = lp.options();
  auto count = at::zeros({E}, opts.dtype(at::kLong));
  at::Tensor sums;
  const bool given = exec_logratio_sum.has_value();
  if (given) {
    TORCH_CHECK(exec_logratio_sum->dim() == 1 && exec_logratio_sum->size(0) == E,
                "gyre::gspo_loss: exec_logratio_sum must be [E]=", E);
    sums = exec_logratio_sum->to(dev, at::kDouble).contiguous();
  } else {
    sums = at::zeros({E}, opts);
  }
  if (n > 0) {
    segment_sums_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        lp.data_ptr<double>(), b.data_ptr<double>(), m.data_ptr<bool>(), ix.data_ptr<int64_t>(), n,
        given ? nullptr : sums.data_ptr<double>(), reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  TORCH_CHECK(!at::logical_and(count > 0, len <= 0).any().item<bool>(),
              "gyre::gspo_loss: exec_lengths has L_i <= 0 for an execution with targets here");
  auto ratio = at::empty({E}, opts);
  auto gate = at::empty({E}, opts);
  if (E > 0) {
    gate_kernel<<<blocks_for(E), kThreads, 0, stream>>>(sums.data_ptr<double>(), adv.data_ptr<double>(),
                                                        len.data_ptr<int64_t>(), E, eps_low, eps_high,
                                                        ratio.data_ptr<double>(), gate.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  auto coeff = at::zeros({n}, opts);
  auto acc = at::zeros({4}, opts);
  if (n > 0) {
    token_kernel<<<blocks_for(n), kThreads, 0, stream>>>(lp.data_ptr<double>(), b.data_ptr<double>(),
                                                         m.data_ptr<bool>(), ix.data_ptr<int64_t>(),
                                                         tw.data_ptr<double>(), gate.data_ptr<double>(), n, cap,
                                                         coeff.data_ptr<double>(), acc.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {acc.select(0, 0).clone(), coeff, ratio, gate, count, acc.slice(0, 1, 4).clone()};
}

}  // namespace
}  // namespace gyre

TORCH_LIBRARY_IMPL(gyre, CUDA, m) {
  m.impl("exec_logratio_sums", &gyre::exec_logratio_sums_cuda);
  m.impl("gspo_loss_fwd", &gyre::gspo_loss_fwd_cuda);
}
