// Declarations shared by the gyre:: ops (gyre/csrc). Shapes follow gyre/loss/_ext.py.
#pragma once

#include <ATen/ATen.h>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <tuple>

namespace gyre {

// A fresh [T, V] gradient is first touched by the kernel; with 4 KiB pages that is one page
// fault per 4 KiB (measured on the 2-core box: as long as the kernel's own arithmetic). With
// GYRE_HUGEPAGES=1, where transparent huge pages are in `madvise` mode, ask for 2 MiB pages on
// the buffer's interior. Opt-in: measured 2x faster backward in steady state, but the kernel's
// direct compaction made single calls stall for seconds (28 s once) on a loaded machine.
inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const char* on = std::getenv("GYRE_HUGEPAGES");
  if (!t.device().is_cpu() || on == nullptr || on[0] != '1') return;
  constexpr uintptr_t kHuge = 2u << 20;
  const size_t bytes = t.numel() * t.element_size();
  if (bytes < 8 * kHuge) return;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(t.data_ptr()) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(t.data_ptr()) + bytes) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // advisory: errors ignored
#endif
}


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
