// Declarations shared by the gyre:: ops (gyre/csrc). Shapes follow gyre/loss/_ext.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace gyre {

// --- fused log-prob gather (logprobs_cpu.cpp, cuda/logprobs.cu) ----------------------------
// Writes logprobs[t] = logits[t, y_t] - lse[t] and lse[t] (float64) for rows of a contiguous
// [T, V] logits tensor. `out` is float32 (float64 for float64 logits).
void logprobs_fwd_into_cpu(const at::Tensor& logits, const at::Tensor& targets, at::Tensor& out, at::Tensor& lse);
// grad_logits[t, v] = g_t * (onehot(y_t)[v] - exp(logits[t, v] - lse[t])). `grad_logits` may be
// `logits` itself (in place, used by the chunked path).
void logprobs_bwd_into_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                           const at::Tensor& lse, at::Tensor& grad_logits);

// Checks shared by CPU and CUDA kernels; `name` prefixes the error message.
void check_logits_targets(const at::Tensor& logits, const at::Tensor& targets, const char* name);
at::ScalarType logprob_out_dtype(at::ScalarType in);

// --- chunked path from hidden states (chunked.h) ------------------------------------------
// --- packed GSPO loss (gspo_cpu.cpp, cuda/gspo.cu) -----------------------------------------
at::Tensor exec_logratio_sums_cpu(const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask,
                                  const at::Tensor& exec_index, int64_t num_exec);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gspo_loss_fwd_cpu(
    const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask, const at::Tensor& exec_index,
    const at::Tensor& token_weight, const at::Tensor& advantages, const at::Tensor& exec_lengths,
    const c10::optional<at::Tensor>& exec_logratio_sum, double eps_low, double eps_high, double cap);
void check_packed(const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask,
                  const at::Tensor& exec_index, const at::Tensor* token_weight, int64_t num_exec);

}  // namespace gyre
