// CPU kernel of diffpolicy::group_norm_mish and its backward: y = mish(group_norm(x) * weight + bias),
// the Conv -> GroupNorm -> Mish block of the 1-D U-Net, float32, x (B, C, L) contiguous.
//
// Why a kernel: at the U-Net's training shapes (C * L of 1024 per sample) ATen runs GroupNorm and Mish
// as separate passes, Mish with three transcendentals an element (tanh(log1p(exp z))) forward and
// again backward, and GroupNorm's backward as a generic reduction. Here one pass per sample computes
// the statistics, one more the activation; mish needs a single exp,
//
//   e = exp(z),  n = e (e + 2),  tanh(softplus(z)) = n / (n + 2),  mish(z) = z n / (n + 2),
//   mish'(z) = w + z (1 - w^2) sigmoid(z)   with w = n / (n + 2), sigmoid(z) = e / (1 + e),
//
// and the backward stores d(loss)/dz in dx, reduces it per channel and group, then turns dx into the
// input's gradient in place:
//
//   dx = rstd w_c dz - rstd S1 / n - rstd^2 (x - mean) S2 / n,
//   S1 = sum_c w_c sum_l dz,  S2 = sum_c w_c sum_l dz xhat,  n = (C / G) L.
//
// The flat loops run over a sample's C * L elements with per-element coefficients, so the compiler
// vectorises them whatever L is; exp is a Cody-Waite reduction and a degree-6 polynomial (relative
// error < 2e-7 over the clamped range) written in plain arithmetic for the same reason. On x86-64 an
// AVX2 clone of each loop is chosen at load time. The Python side (diffpolicy/ops/_group_norm_mish.py)
// defines the schemas, the autograd function and the pure-torch reference these are tested against.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace diffpolicy {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define DIFFPOLICY_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DIFFPOLICY_SIMD_CLONES
#endif

// exp(x) for x in [-87, 20] (callers clamp): round-to-nearest by the 1.5 * 2^23 shifter, two-part ln 2,
// Taylor polynomial of degree 6 on |r| <= ln2 / 2, and 2^k built in the exponent bits.
__attribute__((always_inline)) inline float exp_clamped(float x) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float t = x * 1.44269504088896341f + shifter;
  const float k = t - shifter;
  int32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
  const int32_t ki = t_bits - 0x4B400000;  // the integer k held in t's mantissa
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t scale_bits = (ki + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

constexpr float kExpLo = -87.0f;
constexpr float kExpHi = 20.0f;  // mish(z) = z and mish'(z) = 1 to float precision above

// The loops take the clamp bounds as arguments: with the constants in view GCC 12 threads the clamp's
// branches through the polynomial (folding exp of each bound) and no longer vectorises the loop.
__attribute__((always_inline)) inline float clamp(float z, float lo, float hi) {
  const float c = z < lo ? lo : z;
  return c > hi ? hi : c;
}

// y[i] = mish(x[i] * a[i] + s[i]) over n elements.
DIFFPOLICY_SIMD_CLONES void mish_affine_forward(const float* __restrict__ x, const float* __restrict__ a,
                                                const float* __restrict__ s, float* __restrict__ y,
                                                int64_t n, float lo, float hi) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float z = x[i] * a[i] + s[i];
    const float e = exp_clamped(clamp(z, lo, hi));
    const float q = e * (e + 2.0f);
    y[i] = z * (q / (q + 2.0f));
  }
}

// dz[i] = dy[i] * mish'(x[i] * a[i] + s[i]) over n elements.
DIFFPOLICY_SIMD_CLONES void mish_affine_backward(const float* __restrict__ dy, const float* __restrict__ x,
                                                 const float* __restrict__ a, const float* __restrict__ s,
                                                 float* __restrict__ dz, int64_t n, float lo,
                                                 float hi) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float z = x[i] * a[i] + s[i];
    const float e = exp_clamped(clamp(z, lo, hi));
    const float q = e * (e + 2.0f);
    const float w = q / (q + 2.0f);
    const float sig = e / (1.0f + e);
    dz[i] = dy[i] * (w + z * (1.0f - w * w) * sig);
  }
}

// dx[i] = a[i] * dx[i] + beta * x[i] + gamma over n elements (dx holds dz on entry).
DIFFPOLICY_SIMD_CLONES void group_input_grad(const float* __restrict__ x, const float* __restrict__ a,
                                             float* __restrict__ dx, float beta, float gamma, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = a[i] * dx[i] + beta * x[i] + gamma;
  }
}

// Mean and 1 / sqrt(var + eps) of n contiguous elements in two passes (the mean, then the squared
// deviations from it), each summed in eight float lanes that the compiler maps onto one vector register
// (a float reduction is not vectorised otherwise), the lanes added in double.
DIFFPOLICY_SIMD_CLONES void moments(const float* __restrict__ x, int64_t n, double eps, float* mean_out,
                                    float* rstd_out) {
  constexpr int64_t kLanes = 8;
  const int64_t whole = n / kLanes * kLanes;
  float acc[kLanes] = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  }
  double sum = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  for (int64_t i = whole; i < n; ++i) sum += x[i];
  const double mean_d = sum / static_cast<double>(n);
  const float mean = static_cast<float>(mean_d);
  float sq_acc[kLanes] = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float d = x[i + j] - mean;
      sq_acc[j] += d * d;
    }
  }
  double sq = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) sq += sq_acc[j];
  for (int64_t i = whole; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - mean;
    sq += d * d;
  }
  *mean_out = mean;
  *rstd_out = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(n) + eps));
}

// Per-element coefficients of one sample: a = rstd_g w_c, s = b_c - mean_g a.
inline void coefficients(const float* mean, const float* rstd, const float* w, const float* b, int64_t C,
                         int64_t L, int64_t Cg, float* a, float* s) {
  for (int64_t c = 0; c < C; ++c) {
    const int64_t g = c / Cg;
    const float ac = rstd[g] * (w ? w[c] : 1.0f);
    const float sc = (b ? b[c] : 0.0f) - mean[g] * ac;
    std::fill(a + c * L, a + (c + 1) * L, ac);
    std::fill(s + c * L, s + (c + 1) * L, sc);
  }
}

void check(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
           int64_t groups) {
  TORCH_CHECK(x.dim() == 3, "diffpolicy::group_norm_mish: x must be (B, C, L), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "diffpolicy::group_norm_mish: the CPU kernel is float32 only");
  TORCH_CHECK(groups > 0 && x.size(1) % groups == 0, "diffpolicy::group_norm_mish: ", groups,
              " groups do not divide ", x.size(1), " channels");
  for (const auto* p : {&weight, &bias}) {
    if (p->has_value()) {
      TORCH_CHECK((*p)->dim() == 1 && (*p)->size(0) == x.size(1) && (*p)->scalar_type() == at::kFloat,
                  "diffpolicy::group_norm_mish: weight and bias must be float32 (C,)");
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_mish_cpu(const at::Tensor& x_in,
                                                                    const c10::optional<at::Tensor>& weight,
                                                                    const c10::optional<at::Tensor>& bias,
                                                                    int64_t groups, double eps) {
  check(x_in, weight, bias, groups);
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), C = x.size(1), L = x.size(2), G = groups, Cg = C / G, n = Cg * L;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mean = at::empty({B, G}, x.options());
  at::Tensor rstd = at::empty({B, G}, x.options());
  const at::Tensor w_t = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor b_t = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* w = w_t.defined() ? w_t.const_data_ptr<float>() : nullptr;
  const float* b = b_t.defined() ? b_t.const_data_ptr<float>() : nullptr;
  const float* xp = x.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  float* mp = mean.mutable_data_ptr<float>();
  float* rp = rstd.mutable_data_ptr<float>();
  const int64_t per = C * L;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(per, 1));
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> a(per), s(per);
    for (int64_t i = b0; i < b1; ++i) {
      const float* xi = xp + i * per;
      for (int64_t g = 0; g < G; ++g) moments(xi + g * n, n, eps, mp + i * G + g, rp + i * G + g);
      coefficients(mp + i * G, rp + i * G, w, b, C, L, Cg, a.data(), s.data());
      mish_affine_forward(xi, a.data(), s.data(), yp + i * per, per, kExpLo, kExpHi);
    }
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_mish_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& mean_in, const at::Tensor& rstd_in,
    int64_t groups) {
  check(x_in, weight, bias, groups);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes() && grad_in.scalar_type() == at::kFloat,
              "diffpolicy::group_norm_mish_backward: grad must be float32 shaped like x");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor dy = grad_in.contiguous();
  const at::Tensor mean = mean_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const int64_t B = x.size(0), C = x.size(1), L = x.size(2), G = groups, Cg = C / G, n = Cg * L;
  TORCH_CHECK(mean.numel() == B * G && rstd.numel() == B * G,
              "diffpolicy::group_norm_mish_backward: mean and rstd must be (B, groups)");
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dw_partial = at::empty({B, C}, x.options());  // per sample: sum_l dz xhat
  at::Tensor db_partial = at::empty({B, C}, x.options());  // per sample: sum_l dz
  const at::Tensor w_t = weight.has_value() ? weight->contiguous() : at::Tensor();
  const at::Tensor b_t = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* w = w_t.defined() ? w_t.const_data_ptr<float>() : nullptr;
  const float* b = b_t.defined() ? b_t.const_data_ptr<float>() : nullptr;
  const float* xp = x.const_data_ptr<float>();
  const float* gp = dy.const_data_ptr<float>();
  const float* mp = mean.const_data_ptr<float>();
  const float* rp = rstd.const_data_ptr<float>();
  float* dxp = dx.mutable_data_ptr<float>();
  float* dwp = dw_partial.mutable_data_ptr<float>();
  float* dbp = db_partial.mutable_data_ptr<float>();
  const int64_t per = C * L;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(per, 1));
  const double inv_n = 1.0 / static_cast<double>(n);
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> a(per), s(per);
    for (int64_t i = b0; i < b1; ++i) {
      const float* xi = xp + i * per;
      float* dxi = dxp + i * per;
      const float* mi = mp + i * G;
      const float* ri = rp + i * G;
      coefficients(mi, ri, w, b, C, L, Cg, a.data(), s.data());
      mish_affine_backward(gp + i * per, xi, a.data(), s.data(), dxi, per, kExpLo, kExpHi);  // dx <- dz
      for (int64_t g = 0; g < G; ++g) {
        double s1 = 0.0, s2 = 0.0;
        for (int64_t c = g * Cg; c < (g + 1) * Cg; ++c) {
          const float* xr = xi + c * L;
          const float* dzr = dxi + c * L;
          float sum_dz = 0.0f, sum_dz_xhat = 0.0f;
          for (int64_t l = 0; l < L; ++l) {
            sum_dz += dzr[l];
            sum_dz_xhat += dzr[l] * (xr[l] - mi[g]) * ri[g];
          }
          dbp[i * C + c] = sum_dz;
          dwp[i * C + c] = sum_dz_xhat;
          const double wc = w ? w[c] : 1.0;
          s1 += wc * sum_dz;
          s2 += wc * sum_dz_xhat;
        }
        const double r = ri[g];
        const float beta = static_cast<float>(-r * s2 * inv_n * r);
        const float gamma = static_cast<float>(-r * s1 * inv_n + r * r * mi[g] * s2 * inv_n);
        // a holds rstd_g w_c: the first term of dx
        group_input_grad(xi + g * n, a.data() + g * n, dxi + g * n, beta, gamma, n);
      }
    }
  });
  // The affine parameters' gradients (C,); without weight and bias they are what those would receive.
  return {dx, at::sum(dw_partial, {0}), at::sum(db_partial, {0})};
}

}  // namespace
}  // namespace diffpolicy

TORCH_LIBRARY_IMPL(diffpolicy, CPU, m) {
  m.impl("group_norm_mish", &diffpolicy::group_norm_mish_cpu);
  m.impl("group_norm_mish_backward", &diffpolicy::group_norm_mish_backward_cpu);
}
