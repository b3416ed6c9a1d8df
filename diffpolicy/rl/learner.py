"""The one face every fine-tuning learner shows ``train.py``, the registry that names them, and what they share.

A learner (``chain``, ``residual``, ``fpo``, ``filtered_bc``; chosen by ``algo=<entry>``) lives in one unit under
``diffpolicy/rl/`` (a module or a package holding its rollout specifics and its update) and declares its
name once, with :func:`register`. It owns its environments, buffer, critic and optimisers; the loop around
it (seeding, logging, checkpoints, the rollback guard, sums over ranks) is ``train.py``'s and calls only
what :class:`Learner` lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from diffpolicy import checkpoint


@dataclass
class RolloutStats:
    """What one rollout saw (every learner's, whatever it stores per decision or control step)."""

    env_steps: int = 0
    """Environment (control) steps executed, summed over environments."""
    episodes: int = 0
    """Episodes that ended during the rollout."""
    successes: int = 0
    """Of those, successful ones."""
    returns: list[float] = field(default_factory=list)
    """Return of every ended episode."""
    policy_s: float = 0.0
    """Seconds spent sampling the policy (and critic) during the rollout."""
    env_s: float = 0.0
    """Seconds spent stepping the environments during the rollout."""

    def end_episode(self, episode_return: float, success: bool) -> None:
        """Count one episode that ended: its return and whether it succeeded."""
        self.episodes += 1
        self.successes += int(success)
        self.returns.append(float(episode_return))

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")


@runtime_checkable
class Learner(Protocol):
    """What ``train.py`` may call on a learner; nothing else is reached for.

    ``policy`` is what is evaluated during training; ``saved_policy()`` what a checkpoint stores as the policy
    (the residual learner's frozen base) with ``artifact()``'s extra state and description beside it.
    """

    policy: Any

    def begin(self) -> None:
        """Called once the starting weights are in place (fresh or resumed)."""

    def rollout(self, seed: int) -> RolloutStats:
        """Collect one iteration's experience from environments reset with seeds derived from ``seed``."""

    def update(self, seed: int, step: int, iteration: int) -> dict[str, float]:
        """Learn from the last rollout; -> scalar metrics (``losses/*``, ``rollout/*``)."""

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint needs to continue bit for bit, besides the policy's weights and the RNG."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (and the trained weights) from a checkpoint's state."""

    def load_weights(self, state: dict[str, Any]) -> None:
        """Restore the trained weights only (what a rollback restores)."""

    def modules(self) -> list[torch.nn.Module]:
        """Modules rank 0 broadcasts at the start."""

    def saved_policy(self) -> Any:
        """The policy a checkpoint stores."""

    def artifact(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(extra state, JSON description) stored with the saved policy."""

    def on_rollback(self) -> None:
        """React to a rollback, after the weights were restored."""

    def close(self) -> None:
        """Release environments and workers."""


def env_seeds(cfg: Any, base: int) -> list[int]:
    """Reset seed per environment of a rollout; GRPO (``algo.advantage=grpo``) puts G consecutive
    environments on the same seed (a group)."""
    n, g = cfg.env.num_envs, getattr(cfg.algo, "group_size", 1)
    if getattr(cfg.algo, "advantage", "gae") == "grpo":
        return [base + i // g for i in range(n)]
    return [base + i for i in range(n)]


LEARNERS: dict[str, type] = {}
"""Learner name (its config schema's ``learner`` constant) -> learner class, filled by :func:`register` as the
learner modules are imported."""
LEARNER_MODULES = (
    "diffpolicy.rl.chain",
    "diffpolicy.rl.residual",
    "diffpolicy.rl.fpo",
    "diffpolicy.rl.filtered_bc",
)
"""The modules that register learners (imported on first use of the registry)."""


def register(config: type) -> Callable[[type], type]:
    """Class decorator: the learner reads ``config`` (a :class:`~diffpolicy.config.LearnerConfig` schema),
    and registers under that schema's ``learner`` constant, the name's one declaration."""
    name = config.learner

    def add(cls: type) -> type:
        if name in LEARNERS and LEARNERS[name] is not cls:
            raise ValueError(
                f"learner {name!r} is registered twice ({LEARNERS[name].__name__}, {cls.__name__})"
            )
        LEARNERS[name] = cls
        cls.name, cls.config = name, config
        return cls

    return add


def learner_class(name: str) -> type:
    """The learner class registered as ``name``."""
    for module in LEARNER_MODULES:
        importlib.import_module(module)
    if name not in LEARNERS:
        raise ValueError(f"learner {name!r} is not registered; choose one of {', '.join(sorted(LEARNERS))}")
    return LEARNERS[name]


def make_learner(cfg: Any, rt: Any, info: Any, policy: Any, logger: Any) -> Learner:
    """The learner whose schema ``cfg.algo`` is (``algo=<entry>``), around the pre-trained ``policy``."""
    cls = learner_class(cfg.algo.learner)
    if not isinstance(cfg.algo, cls.config):
        raise TypeError(f"the {cls.name} learner reads {cls.config.__name__}, got {type(cfg.algo).__name__}")
    learner = cls(cfg, rt, info, policy, logger)
    if not isinstance(learner, Learner):
        raise TypeError(f"{type(learner).__name__} does not implement the Learner protocol")
    return learner


class PolicyLearner:
    """Base of the learners that train the diffusion policy itself (chain, FPO, filtered_bc): the saved
    policy is ``self.policy``; with K' < K the frozen pre-trained denoiser of the first K - K' steps rides
    with it, so ``evaluate``/``export``/``serve`` sample those steps as training did; ``self.venv`` is closed
    at the end."""

    policy: Any
    venv: Any

    def begin(self) -> None:
        """Nothing to prepare."""

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
