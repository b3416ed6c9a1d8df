"""A high-level selector over a language-conditioned policy: which sub-task instruction next.

:class:`SubtaskSelector` reads the observation and the dialogue (the multi-stage instruction, and what was
said since) and names the sub-task to do now, one of a fixed vocabulary of one-step instructions ("put the red
cube in the yellow tray") learned from demonstrations labelled with them. :class:`HierarchicalPolicy` puts it
above a low-level policy: it chooses once per decision (every Te control steps), and the low-level policy acts
on the chosen instruction. A person's correction overrides it: the utterances said after the task's instruction follow the chosen sub-task in the
dialogue the low-level policy reads ("put the red cube in the yellow tray\\nno, the blue one"), as a policy
trained on mujoco_dialogue's corrections reads them.

With ``plan_slots`` = S > 0 the selector reads the plan from the words and the progress from the scene:
p(v | obs, dialogue) = sum_s p(s | obs, dialogue) p(v | dialogue, s), where the second factor (which sub-task
the dialogue puts in slot s) never sees the observation. It cannot learn an episode's sub-task from its
scene (a plain classifier fits its training episodes that way and then names sub-tasks the instruction does
not contain, docs/experiments.md, 2026-12-07 eighth session); the scene only chooses a slot. Demonstrations
say which slot each step is at (its sub-task's place in the episode, :meth:`DemoWindows.subtask_order
<diffpolicy.data.windows.DemoWindows.subtask_order>`), so both factors are trained on their own labels; a
person's correction, which does not, trains the marginal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from diffpolicy.config import EncoderConfig
from diffpolicy.data.dataset import SUBTASK_KEY
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.encoders.memory import TURN_SEP, InstructionMemory


class SubtaskSelector(nn.Module):
    """(observation, dialogue) -> logits (B, V) over ``vocabulary`` (V sub-task instructions).

    The observation goes through an :class:`~diffpolicy.encoders.fusion.ObservationEncoder` (the same
    encoders as a diffusion policy's; the dialogue through its instruction memory when
    ``encoder.text_memory`` > 0) into a vector of ``hidden`` features, then a Mish-MLP head.

    Args:
        encoder: the encoders' configuration.
        obs_spec: observation key -> per-step shape (``instruction``: any value).
        vocabulary: the V sub-task instructions it chooses from.
        hidden: width of the encoder's output and of the head.
        text_backend: the frozen sentence encoder (``minilm``; ``hash`` for tests).
        plan_slots: S > 0: the plan is read from the dialogue alone into S slots and the observation chooses
            the slot (module docstring); 0: one classifier over the observation and the dialogue together.
    """

    def __init__(
        self,
        encoder: EncoderConfig,
        obs_spec: Mapping[str, Any],
        vocabulary: list[str],
        hidden: int = 128,
        text_backend: str = "minilm",
        plan_slots: int = 0,
    ) -> None:
        super().__init__()
        if len(vocabulary) < 2 or len(set(vocabulary)) != len(vocabulary):
            raise ValueError(f"a selector needs >= 2 distinct sub-task instructions, got {vocabulary!r}")
        if plan_slots < 0:
            raise ValueError(f"plan_slots must be >= 0, got {plan_slots}")
        self.vocabulary = list(vocabulary)
        self.plan_slots = plan_slots
        self.obs_encoder = ObservationEncoder(encoder, obs_spec, 1, hidden, text_backend=text_backend)
        out = plan_slots or len(vocabulary)  # with a plan the observation's head chooses a slot
        self.head = nn.Sequential(nn.Mish(), nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, out))
        if plan_slots:
            if not self.obs_encoder.use_text:
                raise ValueError(
                    "a selector with plan_slots reads its plan from the instruction: the observation has none"
                )
            self.plan = InstructionMemory(
                hidden, plan_slots, encoder.text_memory_turns, encoder.fusion_heads, backend=text_backend,
                standardize=encoder.text_standardize,
            )  # fmt: skip
            self.slots = nn.Parameter(torch.randn(plan_slots, hidden))
            """Each slot's own embedding: the memory starts every slot at the latest utterance, and slots that
            start the same get the same gradients, a symmetry this breaks from the first step."""
            self.plan_head = nn.Sequential(
                nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.Mish(), nn.Linear(hidden, len(vocabulary))
            )

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(
        self, obs: Mapping[str, Any], augment: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """obs as a policy reads it (tensors (B, 1, ...), ``instruction`` B strings) -> logits (B, V); with a
        plan, the log-probabilities of the marginal over its slots (module docstring)."""
        if not self.plan_slots:
            return self.head(self.obs_encoder(obs, augment, generator))
        return self.marginal(*self.factors(obs, augment, generator))

    @staticmethod
    def marginal(slot: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """log p(v) = log sum_s p(s) p(v | s) of the two factors' log-probabilities (B, S) and (B, S, V) -> (B, V)."""
        return torch.logsumexp(slot.unsqueeze(-1) + plan, dim=1)

    def factors(
        self, obs: Mapping[str, Any], augment: bool = False, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A planned selector's two factors, float32 log-probabilities: which slot the observation is at
        (B, S), and which sub-task each slot of the dialogue's plan holds (B, S, V)."""
        slot = self.head(self.obs_encoder(obs, augment, generator)).float().log_softmax(-1)
        plan = self.plan_head(self.plan(self.dialogues(obs)) + self.slots)
        return slot, plan.float().log_softmax(-1)

    def fit_text(self, dialogues: list[str]) -> None:
        """Fit the instruction's standardisation (``encoder.text_standardize``) to the training dialogues."""
        self.obs_encoder.fit_text(dialogues)
        if self.plan_slots:
            self.plan.fit(dialogues)

    def dialogues(self, obs: Mapping[str, Any]) -> list[str]:
        """The B dialogues the plan reads ('' under the encoder's text ablation, ``blank_text``)."""
        return ["" if self.obs_encoder.blank_text else str(d) for d in obs["instruction"]]

    @torch.no_grad()
    def select(self, obs: Mapping[str, Any]) -> list[str]:
        """The sub-task instruction to act on now, for each of the B observations."""
        return [self.vocabulary[int(i)] for i in self(obs).argmax(-1)]


class HierarchicalPolicy(nn.Module):
    """A selector above a low-level policy that acts on the sub-task instruction it names.

    The selector chooses at every decision (:meth:`plan`, the one sampling path of evaluation,
    :func:`diffpolicy.policies.base.act`): once per Te control steps (0.8 s at Te = 8 and 10 Hz), the clock on
    which the low-level policy replans, and stateless, so a choice follows what the scene shows (a sub-task is
    over when its cube lies in its tray). The low-level policy reads the chosen sub-task, then the utterances
    said after the task's instruction (a person's correction overrides the choice).

    With ``person`` a simulated person watches as in Yell At Your Robot (Shi et al., RSS 2024): evaluation
    hands it each environment's ``info`` (:meth:`listen`); at a decision where the selector names another
    sub-task than the one the task is at (``info["subtask"]``, what the person means), the person's sub-task
    overrides the choice and the decision is kept in :attr:`corrections` (the observation's last step, the
    dialogue, the corrected sub-task, the first action taken), to train the selector on again
    (:func:`diffpolicy.hierarchy.write_corrections`, ``pretrain policy=selector selector_corrections=...``).

    Args:
        selector: a trained :class:`SubtaskSelector`.
        low: the low-level policy (a diffusion policy trained on sub-task instructions, ``bc.instruction=subtask``).
        person: a simulated person corrects the selector (above).
    """

    def __init__(self, selector: SubtaskSelector, low: nn.Module, person: bool = False) -> None:
        super().__init__()
        self.selector, self.low = selector, low
        self.person = person
        self.decisions = 0
        """Decisions the person watched (environments still in their episode)."""
        self.corrections: list[dict[str, Any]] = []
        self._meant: list[str] | None = None
        self._active: np.ndarray | None = None

    def listen(self, info: Mapping[str, Any], active: np.ndarray) -> None:
        """What the person sees after a reset or a step of B environments: ``info`` (a vector env's, whose
        ``subtask`` is each one's current sub-task) and ``active`` (B,) bool, the environments still in the
        episode being judged. A no-op without ``person``."""
        if not self.person:
            return
        meant = info.get(SUBTASK_KEY)
        if meant is None:
            raise ValueError(
                f"the environment's info has no {SUBTASK_KEY!r}: a person corrects a multi-stage task"
            )
        self._meant, self._active = [str(m) for m in meant], np.asarray(active, dtype=bool)

    def __getattr__(self, name: str) -> Any:  # horizon, n_action_steps, obs_spec, ...: the low level's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["low"], name)

    def instructions(self, obs: Mapping[str, Any]) -> list[str]:
        """What the low-level policy reads: each observation's chosen sub-task (the person's where it corrects
        the choice), then the utterances said after the task's instruction."""
        dialogues = [str(d) for d in obs["instruction"]]
        return [TURN_SEP.join([c, *d.split(TURN_SEP)[1:]]) for c, d in zip(self._choose(obs), dialogues)]

    def _choose(self, obs: Mapping[str, Any]) -> list[str]:
        chosen = self.selector.select(obs)
        if not self.person or self._meant is None:
            return chosen
        for i, (choice, meant) in enumerate(zip(chosen, self._meant)):
            if not self._active[i] or not meant:
                continue
            self.decisions += 1
            if choice != meant:
                chosen[i] = meant
                self.corrections.append({
                    **{k: v[i, -1].detach().cpu().numpy() for k, v in obs.items() if torch.is_tensor(v)},
                    "instruction": str(obs["instruction"][i]), SUBTASK_KEY: meant, "chosen": choice, "row": i,
                })  # fmt: skip
        return chosen

    def plan(self, obs: Mapping[str, Any], **kwargs: Any) -> Any:
        """The low-level policy's ``plan`` on :meth:`instructions` (the one sampling path of evaluation)."""
        start = len(self.corrections)
        actions, out = self.low.plan({**obs, "instruction": self.instructions(obs)}, **kwargs)
        for record in self.corrections[start:]:  # the first action taken on the person's sub-task
            record["action"] = actions[record.pop("row"), 0].detach().float().cpu().numpy()
        return actions, out
