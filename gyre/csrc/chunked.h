// Log-probs from hidden states and the LM-head weight, chunk by chunk (gyre::logprobs_hidden_*).
//
// logits_c = hidden[c] @ weightᵀ is formed for `chunk` rows at a time, reduced by the fused
// row kernel, and dropped; the backward recomputes it, turns it in place into
// g·(onehot − softmax), and multiplies out grad_hidden[c] = G_c @ weight and
// grad_weight += G_cᵀ @ hidden[c]. Peak extra memory: O(chunk · V) (+ a float32 grad_weight
// accumulator for low-precision weights), independent of T — the fused-linear-cross-entropy
// idea. Header-only template so the CPU and CUDA builds share it with their own row kernels.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "gyre_ops.h"

namespace gyre {

inline void check_hidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                         int64_t chunk) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "gyre::logprobs_hidden: hidden [T, H] and weight [V, H] expected, got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "gyre::logprobs_hidden: hidden and weight dtypes differ");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "gyre::logprobs_hidden: targets must be [T]");
  TORCH_CHECK(chunk > 0, "gyre::logprobs_hidden: chunk_size must be positive, got ", chunk);
}

template <class FwdInto>
std::tuple<at::Tensor, at::Tensor> chunked_fwd(const at::Tensor& hidden, const at::Tensor& weight,
                                               const at::Tensor& targets, int64_t chunk, FwdInto fwd_into) {
  check_hidden(hidden, weight, targets, chunk);
  const int64_t T = hidden.size(0);
  auto out = at::empty({T}, hidden.options().dtype(logprob_out_dtype(hidden.scalar_type())));
  auto lse = at::empty({T}, hidden.options().dtype(at::kDouble));
  auto wt = weight.t();
  // One [chunk, V] buffer reused by every chunk: fresh pages per chunk would cost a page fault
  // per 4 KiB each time (measured: as much as the fused kernel itself on CPU).
  auto buf = at::empty({std::min(chunk, T), weight.size(0)}, hidden.options());
  advise_huge_pages(buf);
  for (int64_t lo = 0; lo < T; lo += chunk) {
    const int64_t hi = std::min(lo + chunk, T);
    auto logits = buf.slice(0, 0, hi - lo);  // [c, V]
    at::mm_out(logits, hidden.slice(0, lo, hi), wt);
    auto o = out.slice(0, lo, hi);
    auto l = lse.slice(0, lo, hi);
    fwd_into(logits, targets.slice(0, lo, hi), o, l);
  }
  return {out, lse};
}

template <class BwdInto>
std::tuple<at::Tensor, at::Tensor> chunked_bwd(const at::Tensor& grad, const at::Tensor& hidden,
                                               const at::Tensor& weight, const at::Tensor& targets,
                                               const at::Tensor& lse, int64_t chunk, BwdInto bwd_into) {
  check_hidden(hidden, weight, targets, chunk);
  const int64_t T = hidden.size(0);
  auto grad_hidden = at::empty_like(hidden, at::MemoryFormat::Contiguous);
  const bool lowp = weight.scalar_type() != at::kFloat && weight.scalar_type() != at::kDouble;
  // Accumulate grad_weight in float32 for bf16/fp16 weights: summing chunk products in bf16
  // would lose the small chunks' contributions.
  auto grad_weight = at::zeros(weight.sizes(), weight.options().dtype(lowp ? at::kFloat : weight.scalar_type()));
  auto wt = weight.t();
  auto buf = at::empty({std::min(chunk, T), weight.size(0)}, hidden.options());
  advise_huge_pages(buf);
  for (int64_t lo = 0; lo < T; lo += chunk) {
    const int64_t hi = std::min(lo + chunk, T);
    auto h = hidden.slice(0, lo, hi);
    auto g_logits = buf.slice(0, 0, hi - lo);  // recomputed logits, turned in place into ∂ℓ/∂logits · g
    at::mm_out(g_logits, h, wt);
    bwd_into(grad.slice(0, lo, hi), g_logits, targets.slice(0, lo, hi), lse.slice(0, lo, hi), g_logits);
    auto gh = grad_hidden.slice(0, lo, hi);
    at::mm_out(gh, g_logits, weight);
    if (lowp) {
      grad_weight.add_(at::mm(g_logits.t(), h));
    } else {
      grad_weight.addmm_(g_logits.t(), h);
    }
  }
  return {grad_hidden, lowp ? grad_weight.to(weight.scalar_type()) : grad_weight};
}

}  // namespace gyre
