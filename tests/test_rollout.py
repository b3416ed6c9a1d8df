"""Decision-level execution and the evaluation loop, on a scripted environment with known outcomes."""

from __future__ import annotations

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from diffpolicy.config import EnvConfig
from diffpolicy.env_factory import ActionChunkWrapper
from diffpolicy.evaluation import evaluate, write_video

ENV_ID = "diffpolicy-test/Countdown-v0"


class Countdown(gym.Env):
    """Succeeds after ``3 + seed % 3`` steps (so episodes end in the middle of a chunk), reward 1 per step."""

    observation_space = spaces.Dict({"state": spaces.Box(-np.inf, np.inf, (1,), np.float32)})
    action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self, max_episode_steps: int = 50) -> None:
        self.left = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.left = 3 + (seed or 0) % 3
        return {"state": np.array([self.left], np.float32)}, {}

    def step(self, action):
        self.left -= 1
        done = self.left == 0
        return {"state": np.array([self.left], np.float32)}, 1.0, done, False, {"is_success": done}


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=Countdown)


class ZeroPolicy(torch.nn.Module):
    """Plans zeros; counts its calls."""

    n_action_steps = 2

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def plan(self, obs, *, deterministic=False, return_chain=False, generator=None):
        self.calls += 1
        b = obs["state"].shape[0]
        return torch.zeros(b, self.n_action_steps, 2), SimpleNamespace()


def _cfg() -> EnvConfig:
    return EnvConfig(name="gym", id=ENV_ID, num_envs=3, obs_mode="state", max_episode_steps=50)


def test_chunk_wrapper_stops_at_episode_end_and_sums_rewards() -> None:
    env = ActionChunkWrapper(Countdown(), n_action_steps=4)
    env.reset(seed=0)  # 3 steps to success
    _, reward, term, trunc, info = env.step(np.zeros((4, 2), np.float32))
    assert (reward, term, info["executed"], info["is_success"]) == (3.0, True, 3, True)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros((3, 2), np.float32))


def test_evaluate_counts_successes_that_end_episodes_under_autoreset() -> None:
    policy = ZeroPolicy()
    result = evaluate(
        policy, _cfg(), n_action_steps=2, n_episodes=7, seed=0, num_envs=3, device=torch.device("cpu")
    )
    assert result.episodes == 7 and result.success_rate == 1.0
    expected_steps = sum(3 + s % 3 for s in range(7))
    assert result.env_steps == expected_steps
    assert result.mean_return == pytest.approx(expected_steps / 7)
    assert policy.calls > 0


def test_video_falls_back_to_png_frames_without_ffmpeg(tmp_path, monkeypatch, capsys) -> None:
    import imageio.v2 as imageio

    def no_ffmpeg(*args, **kwargs):
        raise ValueError("Could not find a backend to open the file with mode 'I'")

    monkeypatch.setattr(imageio, "mimsave", no_ffmpeg)
    frames = [np.full((8, 8, 3), i, dtype=np.uint8) for i in range(3)]
    out = write_video(str(tmp_path / "ppo.mp4"), frames, fps=10)
    assert out == str(tmp_path / "ppo") and len(list((tmp_path / "ppo").glob("*.png"))) == 3
    assert np.array_equal(imageio.imread(tmp_path / "ppo" / "00002.png"), frames[2])
    assert capsys.readouterr().out.count("\n") == 1  # a one-line notice
