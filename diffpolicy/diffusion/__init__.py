"""Noise schedule, DDPM loss and the DDIM sampler exposing every step's Gaussian mean and std."""

from diffpolicy.diffusion.sampler import ChainOutput, ddim_sample, ddim_sample_reference
from diffpolicy.diffusion.schedule import (
    NoiseSchedule,
    StepCoefs,
    cosine_betas,
    ddim_step_mean_std,
    ddpm_loss,
)

__all__ = [
    "ChainOutput",
    "NoiseSchedule",
    "StepCoefs",
    "cosine_betas",
    "ddim_sample",
    "ddim_sample_reference",
    "ddim_step_mean_std",
    "ddpm_loss",
]
