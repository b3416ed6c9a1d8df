"""Networks: the conditional 1-D U-Net denoiser, the value head and the Gaussian MLP baseline."""

from diffpolicy.models.critic import Critic
from diffpolicy.models.unet1d import ConditionalUnet1D

__all__ = ["ConditionalUnet1D", "Critic"]
