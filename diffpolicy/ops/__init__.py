"""Python face of kernels/: custom operators with one compiled implementation per device.

``gae`` is the ``diffpolicy::gae`` operator (CPU C++, CUDA, AscendC on NPU, pure-torch fallback);
``gae_reference`` its readable pure-torch oracle; ``group_norm_mish`` the U-Net block's GroupNorm + Mish
(CPU C++ forward and backward, ATen's ops elsewhere), ``group_norm_mish_reference`` its oracle; ``build``
prebuilds the kernels for this machine (also ``python -m diffpolicy.ops``); ``kernel_status`` says which
device types run compiled code.
"""

from diffpolicy.ops._gae import gae, gae_reference
from diffpolicy.ops._group_norm_mish import group_norm_mish, group_norm_mish_reference
from diffpolicy.ops._loader import KernelFallbackWarning, build, cache_dir, kernel_status

__all__ = [
    "KernelFallbackWarning",
    "build",
    "cache_dir",
    "gae",
    "gae_reference",
    "group_norm_mish",
    "group_norm_mish_reference",
    "kernel_status",
]
