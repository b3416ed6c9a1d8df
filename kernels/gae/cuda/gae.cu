// CUDA kernel of the diffpolicy::gae operator (generalised advantage estimation).
//
// One thread per environment n walks the T decisions in reverse with its recursion state in
// registers; neighbouring threads read neighbouring columns of each (T, N) row-major row, so every
// load and store of a warp is coalesced. Built by diffpolicy/ops/_loader.py only when
// torch.cuda.is_available() and nvcc is found. NOT compiled or run in this project's CI (no GPU).
//
//   delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t          (V_T = last_value)
//   A_t     = delta_t + gamma * lam * (1 - d_t) * A_{t+1}      (A_T = 0)
//   R_t     = A_t + V_t

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

namespace diffpolicy {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void gae_kernel(const scalar_t* __restrict__ rewards, const scalar_t* __restrict__ values,
                           const scalar_t* __restrict__ dones, const scalar_t* __restrict__ last_value,
                           scalar_t* __restrict__ advantages, scalar_t* __restrict__ returns, int64_t T,
                           int64_t N, scalar_t gamma, scalar_t gamma_lam) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) {
    return;
  }
  scalar_t next_value = last_value[n];
  scalar_t next_adv = scalar_t(0);
  for (int64_t t = T - 1; t >= 0; --t) {
    const int64_t i = t * N + n;
    const scalar_t not_done = scalar_t(1) - dones[i];
    const scalar_t value = values[i];
    const scalar_t delta = rewards[i] + gamma * next_value * not_done - value;
    next_adv = delta + gamma_lam * not_done * next_adv;
    advantages[i] = next_adv;
    returns[i] = next_adv + value;
    next_value = value;
  }
}

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& dones, const at::Tensor& last_value,
                                            double gamma, double lam) {
  TORCH_CHECK(rewards.dim() == 2, "diffpolicy::gae: rewards must be (T, N), got ", rewards.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes() && dones.sizes() == rewards.sizes(),
              "diffpolicy::gae: rewards, values, dones must share one (T, N) shape");
  TORCH_CHECK(last_value.dim() == 1 && last_value.size(0) == rewards.size(1),
              "diffpolicy::gae: last_value must be (N,)");
  const auto dtype = rewards.scalar_type();
  TORCH_CHECK(values.scalar_type() == dtype && dones.scalar_type() == dtype &&
                  last_value.scalar_type() == dtype,
              "diffpolicy::gae: all inputs must share one dtype");

  const c10::cuda::CUDAGuard guard(rewards.device());
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
  const auto blocks = static_cast<unsigned int>((N + kThreads - 1) / kThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(dtype, "diffpolicy_gae_cuda", [&] {
    gae_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        r.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), d.const_data_ptr<scalar_t>(),
        last.const_data_ptr<scalar_t>(), advantages.mutable_data_ptr<scalar_t>(),
        returns.mutable_data_ptr<scalar_t>(), T, N, static_cast<scalar_t>(gamma),
        static_cast<scalar_t>(gamma * lam));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {advantages, returns};
}

}  // namespace
}  // namespace diffpolicy

TORCH_LIBRARY_IMPL(diffpolicy, CUDA, m) { m.impl("gae", &diffpolicy::gae_cuda); }
