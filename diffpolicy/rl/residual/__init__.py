"""The residual learner: :mod:`.learner` (what ``train.py`` drives), :mod:`.update` (rollout over control steps
and the evidence-scaled update)."""

from diffpolicy.rl.residual.learner import ResidualLearner

__all__ = ["ResidualLearner"]
