"""Training windows of a demonstration dataset for behaviour cloning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy.data.dataset import NON_OBSERVATION_FIELDS, SUBTASK_KEY, TARGET_KEY, DemoReader

INSTRUCTION_SOURCES = ("observed", "subtask")
"""What a window's ``instruction`` is: the observed one, or the step's sub-task label (a low-level policy of a
hierarchy reads the sub-task a selector names)."""


class DemoWindows:
    """Every training window of a demonstration dataset, held in memory and gathered by index.

    Window t (one per stored step of a kept episode): observations at steps t-To+1 .. t (the episode's first
    step repeated before its start; the instruction at step t) and actions t .. t+Ta-1 (its last action
    repeated past its end), never reaching into a neighbouring episode. Episodes marked failed (``success``
    False) are left out. Raw units: the policy normalises actions and state itself.

    Args:
        path: dataset directory (:class:`~diffpolicy.data.dataset.DemoWriter` format).
        obs_horizon: To.
        action_horizon: Ta.
        obs_keys: observation fields to serve (default: every observation field the dataset has; ``action``
            and ``reward`` are not observations).
        instruction: ``observed`` (the step's observed instruction) or ``subtask`` (its sub-task label, which
            multi-stage demonstrations record) served as ``instruction``.
    """

    def __init__(
        self,
        path: str | Path,
        obs_horizon: int,
        action_horizon: int,
        obs_keys: list[str] | None = None,
        instruction: str = "observed",
    ) -> None:
        reader = DemoReader(path)
        self.path = Path(path)
        self.meta = reader.meta
        fields = [k for k in reader.fields if k not in NON_OBSERVATION_FIELDS]
        self.obs_keys = [k for k in (obs_keys or fields) if k in fields]
        self.instructions = list(reader.instructions)
        if instruction not in INSTRUCTION_SOURCES:
            raise ValueError(f"instruction={instruction!r}: choose one of {', '.join(INSTRUCTION_SOURCES)}")
        self.has_subtask = SUBTASK_KEY in reader.fields
        """The dataset records each step's sub-task label (:meth:`subtask`)."""
        if instruction == "subtask" and not (self.has_subtask and "instruction" in self.obs_keys):
            raise ValueError(
                f"demonstrations at {path} record no {SUBTASK_KEY!r} label (a multi-stage task's, "
                "env.kwargs.task=stages) to read as the instruction"
            )
        self.text_field = SUBTASK_KEY if instruction == "subtask" else "instruction"
        self.has_target = TARGET_KEY in reader.fields
        """The dataset records the privileged ``target_pos`` label (:meth:`target`)."""
        labels = [k for k, has in ((TARGET_KEY, self.has_target), (SUBTASK_KEY, self.has_subtask)) if has]
        loaded = [*self.obs_keys, "action", *labels]
        self.data = {k: torch.from_numpy(reader.read(k, 0, reader.num_steps)) for k in loaded}
        success = self.meta["success"]
        keep = [i for i in range(reader.num_episodes) if success[i] is not False]
        if not keep:
            raise ValueError(f"demonstrations at {path} hold no successful episode")
        obs_idx, act_idx, episode = [], [], []
        for j, i in enumerate(keep):
            start, end = int(reader.episode_starts[i]), int(reader.episode_ends[i])
            t = np.arange(start, end)[:, None]  # (L, 1)
            obs_idx.append(np.maximum(t + np.arange(1 - obs_horizon, 1), start))  # (L, To)
            act_idx.append(np.minimum(t + np.arange(action_horizon), end - 1))  # (L, Ta)
            episode.append(np.full(end - start, j))
        self.obs_idx = torch.from_numpy(np.concatenate(obs_idx))  # (N, To)
        self.act_idx = torch.from_numpy(np.concatenate(act_idx))  # (N, Ta)
        self.episode = torch.from_numpy(np.concatenate(episode))  # (N,): each window's kept episode
        self.n_episodes = len(keep)
        self.obs_spec = {
            k: [] if k == "instruction" else list(reader.fields[k]["shape"]) for k in self.obs_keys
        }
        self.action_dim = int(reader.fields["action"]["shape"][0])

    def __len__(self) -> int:
        return len(self.obs_idx)

    def steps(self) -> torch.Tensor:
        """Indices of every stored step that belongs to a kept episode (for fitting normalisers)."""
        return torch.unique(self.obs_idx[:, -1])

    def batch(
        self, idx: torch.Tensor, device: torch.device | str = "cpu"
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """Windows ``idx`` (B,) -> (obs, actions): ``rgb`` (B, To, H, W, 3) uint8, ``points`` (B, To, N, 3),
        ``state`` (B, To, Ds), ``instruction`` list of B strings (at step t); actions (B, Ta, Da) float32."""
        oi = self.obs_idx[idx]  # (B, To)
        obs: dict[str, Any] = {}
        for key in self.obs_keys:
            if key == "instruction":
                obs[key] = [self.instructions[int(j)] for j in self.data[self.text_field][oi[:, -1]]]
            else:
                value = self.data[key][oi]  # (B, To, ...)
                obs[key] = (value if value.dtype == torch.uint8 else value.float()).to(
                    device, non_blocking=True
                )
        actions = self.data["action"][self.act_idx[idx]].float().to(device, non_blocking=True)  # (B, Ta, Da)
        return obs, actions

    def heard(self, idx: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Which chunk steps of windows ``idx`` (B,) act under the instruction the window observes: (B, Ta)
        bool, False from a step whose instruction differs from step t's (a correction said later; with
        ``instruction=subtask``, the next sub-task). None when every step is heard (always for a dataset
        without instructions, or whose instruction never changes)."""
        if "instruction" not in self.obs_keys:
            return None
        text = self.data[self.text_field]
        now = text[self.obs_idx[idx, -1]]  # (B,)
        heard = text[self.act_idx[idx]] == now[:, None]  # (B, Ta)
        return None if bool(heard.all()) else heard.to(device, non_blocking=True)

    def target(self, idx: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """The privileged label of windows ``idx`` (B,): the labelled positions (B, 3 k) m at step t."""
        if not self.has_target:
            raise ValueError(
                f"demonstrations at {self.path} record no {TARGET_KEY!r} (collected before it was recorded, "
                "or imported): collect them again (remove them from the cache) or set bc.target_aux_weight=0"
            )
        return self.data[TARGET_KEY][self.obs_idx[idx, -1]].float().to(device, non_blocking=True)

    def texts(self) -> list[str]:
        """The distinct instructions the windows serve (``instruction``'s source), in first-seen order; [] when
        the demonstrations hold none."""
        if "instruction" not in self.obs_keys:
            return []
        ids = dict.fromkeys(int(j) for j in self.data[self.text_field][self.steps()].tolist())
        return [self.instructions[j] for j in ids]

    def subtask_order(self) -> torch.Tensor:
        """Every window's sub-task's place in its episode (N,) long: 0 for the first sub-task the episode
        labels, 1 for the next new one, ... (a label met again keeps its first place)."""
        if not self.has_subtask:
            raise ValueError(f"demonstrations at {self.path} record no {SUBTASK_KEY!r} label")
        labels = self.data[SUBTASK_KEY][self.obs_idx[:, -1]]
        order = torch.empty(len(self), dtype=torch.long)
        seen: dict[tuple[int, int], int] = {}
        count: dict[int, int] = {}
        for w, (e, label) in enumerate(zip(self.episode.tolist(), labels.tolist())):
            if (e, label) not in seen:
                seen[e, label] = count.get(e, 0)
                count[e] = seen[e, label] + 1
            order[w] = seen[e, label]
        return order

    def subtask(self, idx: torch.Tensor) -> list[str]:
        """The sub-task labels of windows ``idx`` (B,) at step t (multi-stage demonstrations)."""
        if not self.has_subtask:
            raise ValueError(f"demonstrations at {self.path} record no {SUBTASK_KEY!r} label")
        return [self.instructions[int(j)] for j in self.data[SUBTASK_KEY][self.obs_idx[idx, -1]]]


# ---------------------------------------------------------------------------------------------- training
