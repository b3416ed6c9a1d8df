"""The chain learner: :mod:`.learner` (what ``train.py`` drives), :mod:`.rollout` (decisions into the buffer),
:mod:`.update` (the clipped update of the last K' denoising steps)."""

from diffpolicy.rl.chain.learner import ChainLearner, chain_specs

__all__ = ["ChainLearner", "chain_specs"]
