"""What every learner that trains the diffusion policy itself shares: how its policy is saved and restored.

:class:`PolicyHead` is the part of the head interface (``diffpolicy/rl/heads.py``) that the chain head, FPO
and filtered_bc have in common: ``self.policy`` is what is evaluated, saved and served; with K' < K the
frozen pre-trained denoiser of the first K - K' steps rides with it, so ``evaluate``/``export``/``serve``
sample those steps as training did; ``self.venv`` is closed at the end.
"""

from __future__ import annotations

from typing import Any

from diffpolicy import checkpoint


class PolicyHead:
    """Mixin: ``saved_policy``, ``artifact``, ``load_weights``, ``on_rollback`` and ``close`` for a head whose
    trained weights are ``self.policy``'s."""

    policy: Any
    venv: Any

    def saved_policy(self) -> Any:
        return self.policy

    def artifact(self) -> tuple[dict[str, Any], dict[str, Any]]:
        base = getattr(self.policy, "base_denoiser", None)
        return ({"base_denoiser": base.state_dict()} if base is not None else {}), {}

    def load_weights(self, state: dict[str, Any]) -> None:
        checkpoint.load_state(self.policy, state["policy"], name="policy")

    def on_rollback(self) -> None:
        """Nothing beyond the restored weights."""

    def close(self) -> None:
        self.venv.close()
