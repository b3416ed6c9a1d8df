"""PPO fine-tuning parts composed by ``diffpolicy.train``: rollout buffer, advantages, losses, stability.

Symbols (DESIGN.md): T decisions per environment, N environments, B decisions per minibatch, K' fine-tuned
denoising steps, Ta action horizon, Da action dimension. Losses are functions over tensors, not model
classes; everything here runs in float32.
"""

from diffpolicy.rl.advantages import (
    denoise_discount,
    gae_advantages,
    gae_loop_reference,
    grpo_advantages,
    normalize,
)
from diffpolicy.rl.buffer import TEXT, RolloutBuffer, ppo_specs
from diffpolicy.rl.ppo import approx_kl, clip_schedule, grad_bound, policy_loss, regularizer, value_loss
from diffpolicy.rl.stability import (
    GradMonitor,
    RollbackDecision,
    RollbackGuard,
    StateSnapshot,
    global_grad_norm,
    nan_guard,
)

__all__ = [
    "TEXT",
    "GradMonitor",
    "RollbackDecision",
    "RollbackGuard",
    "RolloutBuffer",
    "StateSnapshot",
    "approx_kl",
    "clip_schedule",
    "denoise_discount",
    "gae_advantages",
    "gae_loop_reference",
    "global_grad_norm",
    "grad_bound",
    "grpo_advantages",
    "nan_guard",
    "normalize",
    "policy_loss",
    "ppo_specs",
    "regularizer",
    "value_loss",
]
