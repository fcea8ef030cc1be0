// Fused log-prob gather on CPU: ℓ_t = x[t, y_t] − logsumexp(x[t, :]) without a [T, V] log-softmax.
//
// Forward: one pass over each row in L1-sized blocks. Per block: a vectorized max, then (if the
// max grew) one rescale of the running sum, then a vectorized Σ exp(x − m) while the block is
// still in L1 — so each element is read from memory once and exponentiated once (the
// "online softmax" of FlashAttention / fused-CE kernels, blocked). Sums accumulate in float32
// lanes per block and in float64 across blocks.
// Backward: g_t · (onehot − exp(x − lse)) written row by row, vectorized.
// Rows are spread over threads with at::parallel_for. float32 and bfloat16 take the AVX2 path
// (bf16 widened to float32 on load); other dtypes (float64 for tests, float16) a scalar path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GYRE_AVX2 1
#endif

#include "gyre_ops.h"

namespace gyre {
namespace {

constexpr int64_t kBlock = 2048;  // floats per block: 8 KiB, stays in L1 between the two sweeps

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

#ifdef GYRE_AVX2
// exp for 8 floats: range reduction x = n·ln2 + r, |r| ≤ ln2/2, degree-5 polynomial for e^r
// (Cephes expf coefficients), 2^n through the exponent bits. Max relative error ≈ 2e-7 over
// [-87, 88]; inputs below −87.3 flush to 0 (x − max ≤ 0 here, so only that end matters).
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(x, hi);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, c1, x);
  x = _mm256_fnmadd_ps(fx, c2, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_cvtps_epi32(fx);
  n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(n));
  return _mm256_andnot_ps(underflow, y);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int k = 0; k < 8; ++k) p[k] = c10::BFloat16(tmp[k]);  // round-to-nearest-even
}
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <typename T>
inline float block_max(const T* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    m0 = _mm256_max_ps(m0, load8(x + k));
    m1 = _mm256_max_ps(m1, load8(x + k + 8));
  }
  for (; k + 8 <= n; k += 8) m0 = _mm256_max_ps(m0, load8(x + k));
  float m = hmax(_mm256_max_ps(m0, m1));
  for (; k < n; ++k) m = std::max(m, to_f(x[k]));
  return m;
}

template <typename T>
inline float block_sumexp(const T* x, int64_t n, float mx) {
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(load8(x + k), vm)));
    s1 = _mm256_add_ps(s1, exp256(_mm256_sub_ps(load8(x + k + 8), vm)));
  }
  for (; k + 8 <= n; k += 8) s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(load8(x + k), vm)));
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; k < n; ++k) s += std::exp(to_f(x[k]) - mx);
  return s;
}

// p = exp((x − m) − r) with lse = m + r split so that float32 x − m is exact near the max.
template <typename T>
inline void row_bwd_vec(const T* x, T* out, int64_t V, float g, float m, float r) {
  const __m256 vm = _mm256_set1_ps(m), vr = _mm256_set1_ps(r), vng = _mm256_set1_ps(-g);
  int64_t k = 0;
  for (; k + 8 <= V; k += 8) {
    __m256 p = exp256(_mm256_sub_ps(_mm256_sub_ps(load8(x + k), vm), vr));
    store8(out + k, _mm256_mul_ps(vng, p));
  }
  for (; k < V; ++k) out[k] = T(-g * std::exp((to_f(x[k]) - m) - r));
}
#endif  // GYRE_AVX2

template <typename T>
constexpr bool kVec =
#ifdef GYRE_AVX2
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// Row forward, float32 accumulation (vector path for float / bf16 when AVX2 is available).
template <typename T>
inline double row_lse(const T* x, int64_t V) {
  float m = -INFINITY;
  double s = 0.0;
  for (int64_t lo = 0; lo < V; lo += kBlock) {
    const int64_t n = std::min(kBlock, V - lo);
    float bm = -INFINITY;
#ifdef GYRE_AVX2
    if constexpr (kVec<T>) bm = block_max(x + lo, n);
    else
#endif
      for (int64_t k = 0; k < n; ++k) bm = std::max(bm, to_f(x[lo + k]));
    if (bm > m) {
      s *= std::exp(static_cast<double>(m) - bm);  // running sum rescaled once per new max
      m = bm;
    }
    if (m == -INFINITY) continue;  // every element so far is −inf: contributes 0
#ifdef GYRE_AVX2
    if constexpr (kVec<T>) {
      s += block_sumexp(x + lo, n, m);
      continue;
    }
#endif
    float bs = 0.f;
    for (int64_t k = 0; k < n; ++k) bs += std::exp(to_f(x[lo + k]) - m);
    s += bs;
  }
  return static_cast<double>(m) + std::log(s);
}

// float64 rows (tests, gradcheck): plain two-pass in double.
inline double row_lse_double(const double* x, int64_t V) {
  double m = -INFINITY;
  for (int64_t k = 0; k < V; ++k) m = std::max(m, x[k]);
  if (m == -INFINITY) return m;
  double s = 0.0;
  for (int64_t k = 0; k < V; ++k) s += std::exp(x[k] - m);
  return m + std::log(s);
}

inline int64_t grain_rows(int64_t V) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1)); }

template <typename T, typename O>
void fwd_rows(const T* x, const int64_t* y, int64_t T_, int64_t V, O* out, double* lse) {
  at::parallel_for(0, T_, grain_rows(V), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* row = x + t * V;
      double l;
      if constexpr (std::is_same_v<T, double>) {
        l = row_lse_double(row, V);
      } else {
        l = row_lse(row, V);
      }
      lse[t] = l;
      out[t] = static_cast<O>(static_cast<double>(row[y[t]]) - l);
    }
  });
}

template <typename T>
void bwd_rows(const float* gf, const double* gd, const T* x, const int64_t* y, const double* lse, int64_t T_,
              int64_t V, T* out) {
  at::parallel_for(0, T_, grain_rows(V), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* row = x + t * V;
      T* orow = out + t * V;
      const int64_t yt = y[t];
      const double xy = static_cast<double>(row[yt]);  // read before a possible in-place overwrite
      if constexpr (std::is_same_v<T, double>) {
        const double g = gd[t];
        for (int64_t k = 0; k < V; ++k) orow[k] = -g * std::exp(row[k] - lse[t]);
        orow[yt] = g * (1.0 - std::exp(xy - lse[t]));
      } else {
        const float g = gf[t];
        const float m = static_cast<float>(lse[t]);
        const float r = static_cast<float>(lse[t] - m);
#ifdef GYRE_AVX2
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
          row_bwd_vec(row, orow, V, g, m, r);
        } else
#endif
        {
          for (int64_t k = 0; k < V; ++k) orow[k] = T(-g * std::exp((to_f(row[k]) - m) - r));
        }
        orow[yt] = T(static_cast<float>(g * (1.0 - std::exp(xy - lse[t]))));
      }
    }
  });
}

}  // namespace

at::ScalarType logprob_out_dtype(at::ScalarType in) { return in == at::kDouble ? at::kDouble : at::kFloat; }

void check_logits_targets(const at::Tensor& logits, const at::Tensor& targets, const char* name) {
  TORCH_CHECK(logits.dim() == 2, name, ": logits must be [T, V], got ", logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), name, ": logits must be floating point");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), name, ": targets must be [T]=", logits.size(0),
              ", got ", targets.sizes());
  TORCH_CHECK(targets.scalar_type() == at::kLong, name, ": targets must be int64");
  TORCH_CHECK(logits.size(1) > 0 || logits.size(0) == 0, name, ": V must be positive");
}

static void check_targets_range(const at::Tensor& targets, int64_t V, const char* name) {
  const int64_t* y = targets.data_ptr<int64_t>();
  for (int64_t t = 0; t < targets.numel(); ++t)
    TORCH_CHECK(y[t] >= 0 && y[t] < V, name, ": targets[", t, "] = ", y[t], " out of range [0, ", V, ")");
}

void logprobs_fwd_into_cpu(const at::Tensor& logits, const at::Tensor& targets, at::Tensor& out, at::Tensor& lse) {
  check_logits_targets(logits, targets, "gyre::logprobs_fwd");
  TORCH_CHECK(logits.is_contiguous() && targets.is_contiguous(), "gyre::logprobs_fwd: inputs must be contiguous");
  const int64_t T = logits.size(0), V = logits.size(1);
  check_targets_range(targets, V, "gyre::logprobs_fwd");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "gyre_logprobs_fwd", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      fwd_rows<scalar_t, double>(logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), T, V,
                                 out.data_ptr<double>(), lse.data_ptr<double>());
    } else {
      fwd_rows<scalar_t, float>(logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), T, V,
                                out.data_ptr<float>(), lse.data_ptr<double>());
    }
  });
}

void logprobs_bwd_into_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                           const at::Tensor& lse, at::Tensor& grad_logits) {
  check_logits_targets(logits, targets, "gyre::logprobs_bwd");
  const int64_t T = logits.size(0), V = logits.size(1);
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == T, "gyre::logprobs_bwd: grad must be [T]");
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == T && lse.scalar_type() == at::kDouble,
              "gyre::logprobs_bwd: lse must be [T] float64");
  TORCH_CHECK(logits.is_contiguous() && grad_logits.is_contiguous(), "gyre::logprobs_bwd: logits must be contiguous");
  check_targets_range(targets, V, "gyre::logprobs_bwd");
  auto lse_c = lse.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "gyre_logprobs_bwd", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      auto g = grad.to(at::kDouble).contiguous();
      bwd_rows<scalar_t>(nullptr, g.data_ptr<double>(), logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(),
                         lse_c.data_ptr<double>(), T, V, grad_logits.data_ptr<scalar_t>());
    } else {
      auto g = grad.to(at::kFloat).contiguous();
      bwd_rows<scalar_t>(g.data_ptr<float>(), nullptr, logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(),
                         lse_c.data_ptr<double>(), T, V, grad_logits.data_ptr<scalar_t>());
    }
  });
}

}  // namespace gyre
