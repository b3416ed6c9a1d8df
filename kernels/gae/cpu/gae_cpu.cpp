// CPU kernel of the diffpolicy::gae operator (generalised advantage estimation).
//
// Layout: rewards, values, dones, advantages, returns are (T, N) row-major, last_value is (N).
// The environments (columns) are split into blocks that run in parallel (at::parallel_for); inside a
// block the reverse time loop walks rows T-1 .. 0 and the inner loop runs over the block's contiguous
// columns with no dependency between them, so the compiler vectorises it. The recursion state of a
// block is row t+1 of the values and of the advantages just written, both still in L1. On x86-64 an
// AVX2 clone of the loop is chosen at load time when the CPU has AVX2.
//
//   delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t          (V_T = last_value)
//   A_t     = delta_t + gamma * lam * (1 - d_t) * A_{t+1}      (A_T = 0)
//   R_t     = A_t + V_t
//
// The Python side (diffpolicy/ops) defines the operator schema and validates inputs; the checks here
// only guard direct torch.ops calls.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace diffpolicy {
namespace {

// Columns per parallel task: at least one 64-byte cache line of float32 (no false sharing between
// tasks writing neighbouring columns), at most one 4 KiB page of float32 per row and stream. Long
// contiguous row segments matter: rows are N apart and walked in reverse, and the hardware
// prefetchers only follow a stream inside a page.
constexpr int64_t kMinBlock = 16;
constexpr int64_t kMaxBlock = 1024;
// Problems with fewer elements than this run on the calling thread: waking the thread pool costs
// more than the work (about 0.2 ns per element and thread).
constexpr int64_t kSerialBelow = int64_t{1} << 18;

// One time step of one block: row t from rows t+1 of the values and of the advantages.
template <typename scalar_t>
__attribute__((always_inline)) inline void gae_row(
    const scalar_t* __restrict__ r, const scalar_t* __restrict__ v, const scalar_t* __restrict__ d,
    const scalar_t* __restrict__ next_value, const scalar_t* __restrict__ next_adv,
    scalar_t* __restrict__ adv_out, scalar_t* __restrict__ ret_out, int64_t width, scalar_t gamma,
    scalar_t gamma_lam) {
#pragma GCC ivdep
  for (int64_t j = 0; j < width; ++j) {
    const scalar_t not_done = scalar_t(1) - d[j];
    const scalar_t value = v[j];
    const scalar_t delta = r[j] + gamma * next_value[j] * not_done - value;
    const scalar_t adv = delta + gamma_lam * not_done * next_adv[j];
    adv_out[j] = adv;
    ret_out[j] = adv + value;
  }
}

// Columns [c0, c0 + width) over all T steps, in reverse. The recursion state is row t+1 of the
// values and of the advantages just written, both still in L1: no separate state to store.
template <typename scalar_t>
__attribute__((always_inline)) inline void gae_columns(const scalar_t* rewards, const scalar_t* values,
                                                      const scalar_t* dones, const scalar_t* last_value,
                                                      scalar_t* advantages, scalar_t* returns, int64_t T,
                                                      int64_t N, int64_t c0, int64_t width,
                                                      scalar_t gamma, scalar_t gamma_lam) {
  alignas(64) scalar_t zeros[kMaxBlock] = {};  // A_T = 0
  int64_t row = (T - 1) * N + c0;
  gae_row<scalar_t>(rewards + row, values + row, dones + row, last_value + c0, zeros, advantages + row,
                    returns + row, width, gamma, gamma_lam);
  for (int64_t t = T - 2; t >= 0; --t) {
    const int64_t next = row;
    row -= N;
    gae_row<scalar_t>(rewards + row, values + row, dones + row, values + next, advantages + next,
                      advantages + row, returns + row, width, gamma, gamma_lam);
  }
}

// On x86-64 with glibc, GCC builds an AVX2 clone next to the baseline (SSE2) one and picks it at load
// time (ifunc): 8-wide float32 where the CPU has it, no -march flag, the binary still runs anywhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define DIFFPOLICY_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DIFFPOLICY_SIMD_CLONES
#endif

DIFFPOLICY_SIMD_CLONES void gae_columns_f32(const float* rewards, const float* values, const float* dones,
                                            const float* last_value, float* advantages, float* returns,
                                            int64_t T, int64_t N, int64_t c0, int64_t width, float gamma,
                                            float gamma_lam) {
  gae_columns<float>(rewards, values, dones, last_value, advantages, returns, T, N, c0, width, gamma,
                     gamma_lam);
}

DIFFPOLICY_SIMD_CLONES void gae_columns_f64(const double* rewards, const double* values,
                                            const double* dones, const double* last_value,
                                            double* advantages, double* returns, int64_t T, int64_t N,
                                            int64_t c0, int64_t width, double gamma, double gamma_lam) {
  gae_columns<double>(rewards, values, dones, last_value, advantages, returns, T, N, c0, width, gamma,
                      gamma_lam);
}

inline void gae_columns_any(const float* r, const float* v, const float* d, const float* last, float* a,
                            float* ret, int64_t T, int64_t N, int64_t c0, int64_t width, float g,
                            float gl) {
  gae_columns_f32(r, v, d, last, a, ret, T, N, c0, width, g, gl);
}

inline void gae_columns_any(const double* r, const double* v, const double* d, const double* last,
                            double* a, double* ret, int64_t T, int64_t N, int64_t c0, int64_t width,
                            double g, double gl) {
  gae_columns_f64(r, v, d, last, a, ret, T, N, c0, width, g, gl);
}

void check_inputs(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& dones,
                  const at::Tensor& last_value) {
  TORCH_CHECK(rewards.dim() == 2, "diffpolicy::gae: rewards must be (T, N), got ", rewards.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes() && dones.sizes() == rewards.sizes(),
              "diffpolicy::gae: rewards, values, dones must share one (T, N) shape");
  TORCH_CHECK(last_value.dim() == 1 && last_value.size(0) == rewards.size(1),
              "diffpolicy::gae: last_value must be (N,) with N = ", rewards.size(1));
  const auto dtype = rewards.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "diffpolicy::gae: the CPU kernel supports float32 and float64, got ", dtype);
  TORCH_CHECK(values.scalar_type() == dtype && dones.scalar_type() == dtype &&
                  last_value.scalar_type() == dtype,
              "diffpolicy::gae: all inputs must share one dtype");
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& dones, const at::Tensor& last_value,
                                           double gamma, double lam) {
  check_inputs(rewards, values, dones, last_value);
  const at::Tensor r = rewards.contiguous();
  const at::Tensor v = values.contiguous();
  const at::Tensor d = dones.contiguous();
  const at::Tensor last = last_value.contiguous();
  at::Tensor advantages = at::empty_like(r, at::MemoryFormat::Contiguous);
  at::Tensor returns = at::empty_like(r, at::MemoryFormat::Contiguous);
  const int64_t T = r.size(0);
  const int64_t N = r.size(1);
  if (T == 0 || N == 0) {
    return {advantages, returns};
  }

  // Split the columns evenly over the threads, in whole cache lines, capped at kMaxBlock.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t block = (N + threads - 1) / threads;
  block = (block + kMinBlock - 1) / kMinBlock * kMinBlock;
  block = std::clamp(block, kMinBlock, kMaxBlock);
  const int64_t n_blocks = (N + block - 1) / block;
  const int64_t grain = T * N < kSerialBelow ? n_blocks : 1;

  AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "diffpolicy_gae_cpu", [&] {
    const scalar_t* r_ptr = r.const_data_ptr<scalar_t>();
    const scalar_t* v_ptr = v.const_data_ptr<scalar_t>();
    const scalar_t* d_ptr = d.const_data_ptr<scalar_t>();
    const scalar_t* last_ptr = last.const_data_ptr<scalar_t>();
    scalar_t* a_ptr = advantages.mutable_data_ptr<scalar_t>();
    scalar_t* ret_ptr = returns.mutable_data_ptr<scalar_t>();
    const auto g = static_cast<scalar_t>(gamma);
    const auto gl = static_cast<scalar_t>(gamma * lam);
    at::parallel_for(0, n_blocks, grain, [&](int64_t b_begin, int64_t b_end) {
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t c0 = b * block;
        const int64_t width = std::min(block, N - c0);
        gae_columns_any(r_ptr, v_ptr, d_ptr, last_ptr, a_ptr, ret_ptr, T, N, c0, width, g, gl);
      }
    });
  });
  return {advantages, returns};
}

}  // namespace
}  // namespace diffpolicy

TORCH_LIBRARY_IMPL(diffpolicy, CPU, m) { m.impl("gae", &diffpolicy::gae_cpu); }
