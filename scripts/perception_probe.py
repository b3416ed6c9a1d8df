"""How precisely does a BC policy's condition locate the scene? A linear probe on the encoders' output.

A ridge regression from the policy's condition vector (``policy.encode``, cond_dim values) to the first
object's and the goal's positions (Meta-World's privileged ``label=both``), fitted on the frames of scripted
expert episodes on training scenes (the demonstrations' seeds, 0 ..) and tested on episodes of validation
scenes (100 000 + i): the position error a policy acting on estimated positions (predict-then-act) would see.
Printed as one JSON line: the mean 3-D error in cm per position and split, beside predicting the training
frames' mean position.

    python scripts/perception_probe.py runs/metaworld_bc/push-multimodal/checkpoints --episodes 10

The probe is linear on purpose: it measures what the condition holds, not what a new network could learn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from diffpolicy.config import VAL_SEED
from diffpolicy.demos import run_expert_episode
from diffpolicy.env_factory import make_one_env
from diffpolicy.policies.base import to_policy_obs
from diffpolicy.policy_io import load_policy

POSITIONS = ("object", "goal")
"""What the probe predicts, in this order (3 values each): the env's ``label=both``."""


def frames(env_cfg, seeds: range, every: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Every ``every``-th observation of expert episodes on ``seeds``, its positions (F, 6) m and the index of
    its episode (F,)."""
    from diffpolicy_envs.experts import make_expert

    env = make_one_env(env_cfg, n_action_steps=1, chunked=False)
    try:
        obs: dict[str, list] = {}
        labels = []
        for seed in seeds:
            episode, _ = run_expert_episode(env, make_expert(env, seed=seed, **env_cfg.expert), seed)
            for key in ("rgb", "points", "state"):
                if key in episode:
                    obs.setdefault(key, []).append(episode[key][::every])
            labels.append(episode["target_pos"][::every])
            n = len(labels[-1])
            obs.setdefault("instruction", []).extend([episode.get("instruction", "")] * n)
    finally:
        env.close()
    out = {k: (np.concatenate(v) if k != "instruction" else np.asarray(v)) for k, v in obs.items()}
    episode_of = np.concatenate([np.full(len(y), i) for i, y in enumerate(labels)])
    return out, np.concatenate(labels), episode_of


@torch.no_grad()
def conditions(policy, obs: dict[str, np.ndarray], batch: int = 64) -> np.ndarray:
    """The policy's condition (F, cond_dim) of each frame, without augmentation."""
    n = len(obs["instruction"])
    out = []
    for i in range(0, n, batch):
        part = {k: v[i : i + batch] for k, v in obs.items()}
        out.append(policy.encode(to_policy_obs(part, policy.device), augment=False).float().cpu().numpy())
    return np.concatenate(out)


def ridge(x: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Closed-form ridge on standardised inputs: (mean, std, weights (D + 1, 6)); predict with :func:`apply`."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = np.concatenate([(x - mu) / sd, np.ones((len(x), 1))], axis=1)
    reg = lam * np.eye(z.shape[1])
    reg[-1, -1] = 0.0  # the intercept is not shrunk
    return mu, sd, np.linalg.solve(z.T @ z + reg, z.T @ y)


def apply(model: tuple[np.ndarray, np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    mu, sd, w = model
    return np.concatenate([(x - mu) / sd, np.ones((len(x), 1))], axis=1) @ w


def choose_penalty(x: np.ndarray, y: np.ndarray, episode_of: np.ndarray, grid: tuple[float, ...]) -> float:
    """The penalty of ``grid`` with the lowest leave-one-scene-out error on the training frames (each
    training scene held out in turn): chosen without the validation scenes."""

    def held_out_error(lam: float) -> float:
        errs = []
        for e in np.unique(episode_of):
            out = episode_of == e
            pred = apply(ridge(x[~out], y[~out], lam), x[out])
            errs.append(np.linalg.norm((pred - y[out]).reshape(-1, 3), axis=-1).mean())
        return float(np.mean(errs))

    return min(grid, key=held_out_error)


def errors_cm(pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Mean 3-D error (cm) of each of :data:`POSITIONS`."""
    diff = (pred - y).reshape(len(y), len(POSITIONS), 3)
    return {
        name: round(float(100 * np.linalg.norm(diff[:, i], axis=-1).mean()), 2)
        for i, name in enumerate(POSITIONS)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a BC checkpoint of env=metaworld (a directory, or its root)")
    p.add_argument("--episodes", type=int, default=10, help="expert episodes per split")
    p.add_argument("--every", type=int, default=4, help="keep every k-th frame")
    p.add_argument("--ridge", type=float, nargs="+", default=[1.0, 10.0, 100.0, 1000.0],
                   help="ridge penalties on standardised inputs; the one with the lowest leave-one-scene-out "
                   "error on the training frames is used")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(1)
    policy, env_cfg, _ = load_policy(args.checkpoint, "cpu", env_overrides={"num_envs": 1})
    if env_cfg.name != "metaworld":
        sys.exit(f"error: the probe reads Meta-World's positions; {args.checkpoint} is env={env_cfg.name}")
    env_cfg = type(env_cfg)(**{**env_cfg.__dict__, "kwargs": {**env_cfg.kwargs, "label": "both"}})
    train_obs, train_y, episode_of = frames(env_cfg, range(args.episodes), args.every)
    val_obs, val_y, _ = frames(env_cfg, range(VAL_SEED, VAL_SEED + args.episodes), args.every)
    train_x, val_x = conditions(policy, train_obs), conditions(policy, val_obs)
    lam = choose_penalty(train_x, train_y, episode_of, tuple(args.ridge))
    model = ridge(train_x, train_y, lam)
    mean = np.broadcast_to(train_y.mean(0), val_y.shape)
    print(json.dumps({
        "checkpoint": str(Path(args.checkpoint)), "task": env_cfg.task, "frames": [len(train_y), len(val_y)],
        "train_cm": errors_cm(apply(model, train_x), train_y), "val_cm": errors_cm(apply(model, val_x), val_y),
        "val_cm_predicting_the_mean": errors_cm(mean, val_y), "ridge": lam,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
