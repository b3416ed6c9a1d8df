"""Instruction memory: a dialogue of utterances pooled into k tokens of fixed width, whatever its length.

A dialogue is one string whose utterances are separated by :data:`TURN_SEP` (the format of
``MujocoDialogue-v0``'s ``instruction``: "put the red cube in the purple tray\\nno, the blue one"). Each
utterance goes through the frozen sentence encoder once (the :class:`~diffpolicy.encoders.text.TextEncoder`'s
cache) and its trainable projection: the token a one-sentence instruction gives. Every memory token is the
latest utterance's token plus what the dialogue adds: k learned queries attend over the turns, each given a
learned embedding of its recency (0 the latest utterance, 1 the one before, ...; utterances older than
``max_turns`` are dropped), masked to the dialogue's own turns, then a pre-norm MLP. The layers that write
that context start at zero, so a freshly built memory reads any dialogue as its latest utterance, and a
dialogue of one utterance as the static instruction: training adds the earlier turns only where they help
(a memory whose tokens came from the pooling alone made the static pick task's BC fall from 0.985 to 0.525
on validation, docs/experiments.md 2026-12-07).
"""

from __future__ import annotations

import torch
from torch import nn

from diffpolicy.encoders.attention import Attention
from diffpolicy.encoders.text import EMBED_DIM, TextEncoder

TURN_SEP = "\n"
"""Separator of the utterances in a dialogue string (``diffpolicy_envs.dialogue.TURN_SEP``)."""


def split_turns(dialogue: str, max_turns: int) -> list[str]:
    """The dialogue's last ``max_turns`` utterances, oldest first."""
    return dialogue.split(TURN_SEP)[-max_turns:]


class InstructionMemory(nn.Module):
    """Dialogues (list of B strings) -> memory tokens (B, k, token_dim); see the module docstring.

    Args:
        token_dim: D, the width of the tokens.
        k: memory tokens (learned queries).
        max_turns: utterances read, the latest ones (the recency embeddings' count).
        heads: attention heads of the pooling block.
        backend: the frozen sentence encoder (``minilm`` or ``hash``, :mod:`diffpolicy.encoders.text`).
        standardize: standardise each utterance's embedding (:class:`~diffpolicy.encoders.text.TextEncoder`).
    """

    def __init__(
        self, token_dim: int, k: int, max_turns: int = 8, heads: int = 4, backend: str = "minilm",
        standardize: bool = False,
    ):  # fmt: skip
        super().__init__()
        if k < 1 or max_turns < 1:
            raise ValueError(
                f"an instruction memory needs k >= 1 tokens and max_turns >= 1, got {k}, {max_turns}"
            )
        self.k, self.max_turns = k, max_turns
        self.text = TextEncoder(token_dim, backend=backend, standardize=standardize)
        self.recency = nn.Parameter(torch.randn(max_turns, token_dim) * 0.02)
        self.queries = nn.Parameter(torch.randn(k, token_dim) * 0.02)
        self.norm_q, self.norm_kv = nn.LayerNorm(token_dim), nn.LayerNorm(token_dim)
        self.attn = Attention(token_dim, heads)
        self.norm_mlp = nn.LayerNorm(token_dim)
        self.mlp = nn.Sequential(
            nn.Linear(token_dim, 4 * token_dim), nn.GELU(), nn.Linear(4 * token_dim, token_dim)
        )
        for layer in (self.attn.out, self.mlp[-1]):  # the context starts at zero (module docstring)
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self._frozen: dict[str, torch.Tensor] = {}
        """Dialogue -> its turns' frozen embeddings (T, 384), latest first."""

    def turn_embeddings(self, dialogues: list[str] | tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen embeddings of every turn, latest first, (B, T, 384), and which slots hold a turn (B, T) bool;
        T = the most turns a dialogue of the batch has (<= ``max_turns``)."""
        unique = list(dict.fromkeys(dialogues))
        for d in unique:
            if d not in self._frozen:
                self._frozen[d] = self.text.embed(split_turns(d, self.max_turns)[::-1]).cpu()
        T = max(len(self._frozen[d]) for d in unique)
        emb = torch.zeros(len(unique), T, EMBED_DIM)
        mask = torch.zeros(len(unique), T, dtype=torch.bool)
        for i, d in enumerate(unique):
            e = self._frozen[d]
            emb[i, : len(e)] = e
            mask[i, : len(e)] = True
        if len(unique) < len(dialogues):  # repeated dialogues: gather the unique rows back into the batch
            row = {d: i for i, d in enumerate(unique)}
            index = torch.tensor([row[d] for d in dialogues])
            emb, mask = emb[index], mask[index]
        return emb, mask

    def fit(self, dialogues: list[str] | tuple[str, ...]) -> None:
        """The utterances' standardisation (``standardize``) fitted to every utterance of the training
        dialogues (:meth:`TextEncoder.fit <diffpolicy.encoders.text.TextEncoder.fit>`)."""
        self.text.fit([u for d in dialogues for u in d.split(TURN_SEP)])

    def forward(self, dialogues: list[str] | tuple[str, ...]) -> torch.Tensor:
        return self.read(*self.turn_embeddings(dialogues))

    def read(self, emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The memory (B, k, D) of turns already embedded: ``emb`` (B, T, 384) frozen embeddings, latest
        first, T <= ``max_turns``; ``mask`` (B, T) bool, which slots hold a turn (every dialogue >= 1)."""
        device, dtype = self.queries.device, self.text.proj.weight.dtype
        emb, mask = emb.to(device, dtype), mask.to(device)
        tokens = self.text.project(emb)  # (B, T, D): each utterance's sentence token, the latest first
        turns = self.norm_kv(tokens + self.recency[: emb.shape[1]])
        queries = self.norm_q(self.queries).expand(emb.shape[0], -1, -1)  # (B, k, D)
        context = self.attn(queries, turns, mask)  # (B, k, D)
        context = context + self.mlp(self.norm_mlp(context))
        return tokens[:, :1] + context  # (B, k, D)
