// Torch binding of the AscendC GAE kernel: registers diffpolicy::gae for the NPU dispatch key
// (PrivateUse1, which torch_npu claims). The operator schema is defined on the Python side
// (diffpolicy/ops/_gae.py); loading this library only adds the NPU implementation.
// NOT compiled or run in this project's CI (see ../README.md).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "aclrtlaunch_gae_kernel.h"
#include "gae_tiling.h"
#include "tiling/platform/platform_ascendc.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"

namespace diffpolicy {
namespace {

std::tuple<at::Tensor, at::Tensor> gae_npu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& dones, const at::Tensor& last_value,
                                           double gamma, double lam) {
  TORCH_CHECK(rewards.dim() == 2, "diffpolicy::gae: rewards must be (T, N), got ", rewards.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes() && dones.sizes() == rewards.sizes(),
              "diffpolicy::gae: rewards, values, dones must share one (T, N) shape");
  TORCH_CHECK(last_value.dim() == 1 && last_value.size(0) == rewards.size(1),
              "diffpolicy::gae: last_value must be (N,)");
  for (const at::Tensor* x : {&rewards, &values, &dones, &last_value}) {
    TORCH_CHECK(x->scalar_type() == at::kFloat, "diffpolicy::gae: the NPU kernel supports float32 only");
  }
  const int64_t T = rewards.size(0);
  const int64_t N = rewards.size(1);
  TORCH_CHECK(T <= UINT32_MAX && N <= UINT32_MAX && (N - 1) * 4 <= UINT32_MAX,
              "diffpolicy::gae: (T, N) too large for the NPU kernel");

  const at::Tensor r = rewards.contiguous();
  const at::Tensor v = values.contiguous();
  const at::Tensor d = dones.contiguous();
  const at::Tensor last = last_value.contiguous();
  at::Tensor advantages = at::empty_like(r, at::MemoryFormat::Contiguous);
  at::Tensor returns = at::empty_like(r, at::MemoryFormat::Contiguous);
  if (T == 0 || N == 0) {
    return {advantages, returns};
  }

  auto* platform = platform_ascendc::PlatformAscendCManager::GetInstance();
  uint64_t ub_size = 0;
  platform->GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub_size);
  const uint32_t core_num = platform->GetCoreNumAiv();
  const uint32_t usable_ub = static_cast<uint32_t>(ub_size) - kGaeUbReserveBytes;
  const GaeTilingData tiling =
      ComputeGaeTiling(static_cast<uint32_t>(T), static_cast<uint32_t>(N), core_num, usable_ub);
  TORCH_CHECK(GaeUbBytes(tiling) <= usable_ub, "diffpolicy::gae: tiling does not fit the unified buffer");

  auto stream = c10_npu::getCurrentNPUStream().stream(false);
  ACLRT_LAUNCH_KERNEL(gae_kernel)
  (tiling.usedCores, stream, const_cast<void*>(r.data_ptr()), const_cast<void*>(v.data_ptr()),
   const_cast<void*>(d.data_ptr()), const_cast<void*>(last.data_ptr()), advantages.data_ptr(),
   returns.data_ptr(), tiling.totalT, tiling.totalN, tiling.colsPerCore, tiling.tileCols, tiling.tileT,
   static_cast<float>(gamma), static_cast<float>(lam));
  return {advantages, returns};
}

}  // namespace
}  // namespace diffpolicy

TORCH_LIBRARY_IMPL(diffpolicy, PrivateUse1, m) { m.impl("gae", &diffpolicy::gae_npu); }
