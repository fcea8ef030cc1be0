// Packed execution-level GSPO loss on CPU (DESIGN §6), exact for any packing.
//
//   sums_i  = Σ_{t: mask, exec=i} (ℓ_t − b_t)        (or the caller's full pre-pass sums)
//   s_i     = exp(sums_i / L_i);  m_i = clip gate;  ω_t = min(exp(δ_t), C)
//   coeff_t = mask_t · m_i · ω_t · token_weight_t   (= ∂loss/∂ℓ_t, m and ω are constants)
//   loss    = Σ_t coeff_t · ℓ_t
// All in float64: N is the number of packed tokens (≪ T·V), so this is cheap and the segment
// sums come out the same to ~1e-15 however the targets are cut.

#include <ATen/ATen.h>

#include <cmath>

#include "gyre_ops.h"

namespace gyre {

void check_packed(const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask,
                  const at::Tensor& exec_index, const at::Tensor* token_weight, int64_t num_exec) {
  TORCH_CHECK(logprobs.dim() == 1, "gyre: logprobs must be [N], got ", logprobs.sizes());
  const auto n = logprobs.sizes();
  TORCH_CHECK(behavior.sizes() == n, "gyre: behavior_logprobs must be [N] like logprobs, got ", behavior.sizes());
  TORCH_CHECK(mask.sizes() == n && mask.scalar_type() == at::kBool, "gyre: target_mask must be bool [N]");
  TORCH_CHECK(exec_index.sizes() == n && exec_index.scalar_type() == at::kLong, "gyre: exec_index must be int64 [N]");
  if (token_weight) TORCH_CHECK(token_weight->sizes() == n, "gyre: token_weight must be [N]");
  TORCH_CHECK(num_exec >= 0, "gyre: num_exec must be >= 0");
}

namespace {
struct Packed {
  at::Tensor lp, b, mask, idx;
};
Packed as_double(const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask,
                 const at::Tensor& exec_index, int64_t num_exec) {
  Packed p{logprobs.to(at::kDouble).contiguous(), behavior.to(at::kDouble).contiguous(), mask.contiguous(),
           exec_index.contiguous()};
  const bool* m = p.mask.data_ptr<bool>();
  const int64_t* ix = p.idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < p.lp.numel(); ++t)
    TORCH_CHECK(!m[t] || (ix[t] >= 0 && ix[t] < num_exec), "gyre: exec_index[", t, "] = ", ix[t],
                " out of range [0, ", num_exec, ") on a target position");
  return p;
}
}  // namespace

at::Tensor exec_logratio_sums_cpu(const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask,
                                  const at::Tensor& exec_index, int64_t num_exec) {
  check_packed(logprobs, behavior, mask, exec_index, nullptr, num_exec);
  auto p = as_double(logprobs, behavior, mask, exec_index, num_exec);
  auto sums = at::zeros({num_exec}, logprobs.options().dtype(at::kDouble));
  const double *lp = p.lp.data_ptr<double>(), *b = p.b.data_ptr<double>();
  const bool* m = p.mask.data_ptr<bool>();
  const int64_t* ix = p.idx.data_ptr<int64_t>();
  double* s = sums.data_ptr<double>();
  for (int64_t t = 0; t < p.lp.numel(); ++t)
    if (m[t]) s[ix[t]] += lp[t] - b[t];
  return sums;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gspo_loss_fwd_cpu(
    const at::Tensor& logprobs, const at::Tensor& behavior, const at::Tensor& mask, const at::Tensor& exec_index,
    const at::Tensor& token_weight, const at::Tensor& advantages, const at::Tensor& exec_lengths,
    const c10::optional<at::Tensor>& exec_logratio_sum, double eps_low, double eps_high, double cap) {
  const int64_t E = advantages.numel();
  check_packed(logprobs, behavior, mask, exec_index, &token_weight, E);
  TORCH_CHECK(advantages.dim() == 1 && exec_lengths.sizes() == advantages.sizes(),
              "gyre::gspo_loss: advantages and exec_lengths must both be [E]");
  TORCH_CHECK(cap > 0 && eps_low >= 0 && eps_high >= 0, "gyre::gspo_loss: need cap > 0, eps >= 0");
  auto p = as_double(logprobs, behavior, mask, exec_index, E);
  auto tw = token_weight.to(at::kDouble).contiguous();
  auto adv = advantages.to(at::kDouble).contiguous();
  auto len = exec_lengths.to(at::kLong).contiguous();
  auto opts = logprobs.options().dtype(at::kDouble);
  const int64_t N = p.lp.numel();
  const double *lp = p.lp.data_ptr<double>(), *b = p.b.data_ptr<double>(), *w = tw.data_ptr<double>();
  const bool* m = p.mask.data_ptr<bool>();
  const int64_t* ix = p.idx.data_ptr<int64_t>();

  auto count = at::zeros({E}, logprobs.options().dtype(at::kLong));
  int64_t* cnt = count.data_ptr<int64_t>();
  at::Tensor sums;
  if (exec_logratio_sum.has_value()) {
    TORCH_CHECK(exec_logratio_sum->dim() == 1 && exec_logratio_sum->size(0) == E,
                "gyre::gspo_loss: exec_logratio_sum must be [E]=", E);
    sums = exec_logratio_sum->to(at::kDouble).contiguous();
    for (int64_t t = 0; t < N; ++t)
      if (m[t]) ++cnt[ix[t]];
  } else {
    sums = at::zeros({E}, opts);
    double* s = sums.data_ptr<double>();
    for (int64_t t = 0; t < N; ++t)
      if (m[t]) {
        s[ix[t]] += lp[t] - b[t];
        ++cnt[ix[t]];
      }
  }
  auto ratio = at::empty({E}, opts);
  auto gate = at::empty({E}, opts);
  const double* s = sums.data_ptr<double>();
  const double* a = adv.data_ptr<double>();
  const int64_t* L = len.data_ptr<int64_t>();
  double *r = ratio.data_ptr<double>(), *g = gate.data_ptr<double>();
  for (int64_t i = 0; i < E; ++i) {
    TORCH_CHECK(cnt[i] == 0 || L[i] > 0, "gyre::gspo_loss: exec_lengths[", i, "] = ", L[i],
                " but the execution has targets here");
    TORCH_CHECK(cnt[i] <= L[i] || cnt[i] == 0, "gyre::gspo_loss: execution ", i, " has ", cnt[i],
                " targets here but exec_lengths says L_i = ", L[i]);
    r[i] = std::exp(s[i] / static_cast<double>(std::max<int64_t>(L[i], 1)));
    const bool clipped = (a[i] > 0 && r[i] > 1.0 + eps_high) || (a[i] < 0 && r[i] < 1.0 - eps_low);
    g[i] = clipped ? 0.0 : 1.0;
  }
  auto coeff = at::zeros({N}, opts);
  double* c = coeff.data_ptr<double>();
  double loss = 0.0, n_tok = 0.0, n_cap = 0.0, abs_d = 0.0;
  for (int64_t t = 0; t < N; ++t) {
    if (!m[t]) continue;
    const double d = lp[t] - b[t];
    const double e = std::exp(d);
    const double omega = std::min(e, cap);
    c[t] = g[ix[t]] * omega * w[t];
    loss += c[t] * lp[t];
    n_tok += 1.0;
    n_cap += e > cap ? 1.0 : 0.0;
    abs_d += std::abs(d);
  }
  auto stats = at::empty({3}, opts);
  stats[0] = n_tok;
  stats[1] = n_cap;
  stats[2] = abs_d;
  return {at::scalar_tensor(loss, opts), coeff, ratio, gate, count, stats};
}

}  // namespace gyre
