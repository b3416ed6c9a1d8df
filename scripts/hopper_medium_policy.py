"""Train the medium-quality Hopper policy whose actions are ``env=hopper``'s demonstrations (D4RL's recipe).

D4RL's ``hopper-medium`` holds the episodes of an RL agent stopped at about a third of an expert's return.
Its files cannot be downloaded here, so this script makes the same kind of policy: a stable-baselines3 agent
(the field's reference implementation, ``pip install -e .[rl]``; PPO by default, ``--algo sac`` as D4RL used)
on Gymnasium's ``Hopper-v5``, evaluated every ``--eval-every`` steps on ``--eval-episodes`` episodes sampled
from its own Gaussian (as D4RL's data was), and stopped the first time that mean return reaches
``--stop-return``. The actor is exported to a small ``.npz`` that :class:`diffpolicy_envs.experts.MLPExpert`
runs in numpy, so collecting demonstrations never needs stable-baselines3:

    python scripts/hopper_medium_policy.py --out envs/diffpolicy_envs/assets/hopper_medium.npz

Its ``meta`` entry records the learner, seed, training steps, the return reached and the band the test holds
the file to. The committed ``assets/hopper_medium.npz`` is, like D4RL's hopper-medium, medium in its mean:
``--stop-on mean --stop-return 1300 --stop-below 1800 --eval-every 2048 --band 1100 1700`` (PPO, seed 0,
stopped at 73 728 steps, noise-free return 1386 over the 10 evaluation episodes, 97 s on one core;
``env=hopper`` samples its demonstrations with a tenth of its noise). ``assets/walker2d_medium.npz``:
``--env-id Walker2d-v5`` with the band its ``meta`` records. PPO is the default because SB3's SAC ran at ~38
steps/s on this 2-core machine, PPO at ~500.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

MEDIUM_BAND = (700.0, 1900.0)
"""Mean sampled return that counts as medium quality: 20-55 % of an expert's ~3500 on Hopper (D4RL's
hopper-medium averages ~1420, its expert ~3230); ``tests/test_hopper.py`` holds the committed file to it."""


def export_actor(model, path: str, meta: dict) -> None:
    """SB3 actor -> ``.npz`` in :class:`diffpolicy_envs.experts.MLPExpert`'s format: hidden layers ``w{i}``
    (out, in) / ``b{i}``, the Gaussian's mean ``mu_w``/``mu_b`` and its log-std, and ``meta`` (a JSON string).

    SAC: ReLU layers, a state-dependent log-std ``log_std_w``/``log_std_b`` (before the tanh squash).
    PPO: tanh layers, a state-independent ``log_std`` (Da,), actions clipped to the box; ``meta`` says so
    (``activation``: tanh, ``squash``: clip)."""
    arrays: dict[str, np.ndarray] = {}

    def put(name: str, t: torch.Tensor) -> None:
        arrays[name] = t.detach().cpu().numpy().astype(np.float32)

    if hasattr(model.policy, "actor"):  # SAC
        actor = model.policy.actor
        hidden, mu = actor.latent_pi, actor.mu
        put("log_std_w", actor.log_std.weight)
        put("log_std_b", actor.log_std.bias)
    else:  # PPO: ActorCriticPolicy
        hidden, mu = model.policy.mlp_extractor.policy_net, model.policy.action_net
        put("log_std", model.policy.log_std)
        meta = {**meta, "activation": "tanh", "squash": "clip"}
    for i, layer in enumerate(m for m in hidden if isinstance(m, torch.nn.Linear)):
        put(f"w{i}", layer.weight)
        put(f"b{i}", layer.bias)
    put("mu_w", mu.weight)
    put("mu_b", mu.bias)
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    np.savez_compressed(path, **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="envs/diffpolicy_envs/assets/hopper_medium.npz")
    parser.add_argument("--env-id", default="Hopper-v5")
    parser.add_argument("--algo", choices=("ppo", "sac"), default="ppo", help="stable-baselines3 learner")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-return", type=float, default=1000.0, help="mean return to stop at")
    parser.add_argument(
        "--stop-on", choices=("sampled", "mean"), default="sampled",
        help="judge the return of actions sampled from the actor's Gaussian (D4RL's data) or of its mean (a "
        "demonstrator medium in the mean, whose demonstrations then take a small --noise-scale)",
    )  # fmt: skip
    parser.add_argument(
        "--stop-below", type=float, default=float("inf"),
        help="with --stop-return: stop at the first evaluation inside [stop-return, stop-below] (an early PPO "
        "actor's noise-free return can jump past a band between two evaluations; evaluate every update)",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=300_000)
    parser.add_argument("--eval-every", type=int, default=5_000)
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--band", type=float, nargs=2, default=MEDIUM_BAND, help="return band the test holds the file to"
    )
    args = parser.parse_args()

    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.callbacks import BaseCallback

    from diffpolicy_envs.experts import MLPExpert, run_episode

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    env = gym.make(args.env_id)
    eval_env = gym.make(args.env_id)
    if args.algo == "sac":
        model = SAC("MlpPolicy", env, seed=args.seed, learning_starts=10_000, verbose=0, device="cpu")
        recipe = "stable-baselines3 SAC (defaults, learning_starts 10000)"
    else:
        model = PPO("MlpPolicy", env, seed=args.seed, verbose=0, device="cpu")
        recipe = "stable-baselines3 PPO (defaults: 64x64 tanh, n_steps 2048, 10 epochs, batch 64)"
    tmp = str(Path(tempfile.mkdtemp()) / "actor.npz")  # the evaluated export, outside the repository

    class StopAtMedium(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.reached: float | None = None

        def _on_step(self) -> bool:
            if self.num_timesteps % args.eval_every:
                return True
            export_actor(model, tmp, {})
            expert = MLPExpert.load(tmp, seed=args.seed, stochastic=args.stop_on == "sampled")
            returns = [
                run_episode(eval_env, expert, seed=10_000 + i)["return"] for i in range(args.eval_episodes)
            ]
            mean = float(np.mean(returns))
            print(json.dumps({"steps": self.num_timesteps, "mean_return": round(mean, 1),
                              "wall_s": round(time.perf_counter() - t0)}), flush=True)  # fmt: skip
            if args.stop_return <= mean <= args.stop_below:
                self.reached = mean
                return False
            return True

    callback = StopAtMedium()
    model.learn(total_timesteps=args.max_steps, callback=callback)
    if callback.reached is None:
        raise SystemExit(
            f"error: no evaluation in {args.max_steps} steps reached [{args.stop_return}, {args.stop_below}]; "
            "nothing written (evaluate more often, or widen the band)"
        )
    meta = {
        "algo": recipe,
        "env_id": args.env_id,
        "seed": args.seed,
        "train_steps": int(model.num_timesteps),
        "stop_return": args.stop_return,
        "stop_below": args.stop_below if args.stop_below < float("inf") else None,
        "stop_on": args.stop_on,
        "reached_return": callback.reached,
        "eval_episodes": args.eval_episodes,
        "eval_seeds": f"10000..{10_000 + args.eval_episodes - 1}",
        "sampled": args.stop_on == "sampled",
        "return_band": list(args.band),
    }
    export_actor(model, args.out, meta)
    print(json.dumps({**meta, "out": args.out, "wall_s": round(time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
