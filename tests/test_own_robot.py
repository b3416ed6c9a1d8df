"""Your own robot and data, end to end: a Gymnasium MuJoCo task the project does not own (InvertedPendulum-v5),
demonstrations written by a simple controller into a robomimic-style file, behaviour cloning from that file,
one fine-tuning iteration, then ``evaluate`` on the result."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("h5py", reason='HDF5 datasets need the `data` extra: pip install -e ".[data]"')

from test_external_demos import pendulum_episodes, write_robomimic_file

from diffpolicy import checkpoint, evaluate, train
from diffpolicy.config import EvaluateConfig

TINY = ["policy.down_dims=[16,32]", "policy.cond_dim=32", "policy.step_embed_dim=16", "policy.horizon=16",
        "policy.ddim_steps=4", "policy.encoder.state_hidden=32", "policy.encoder.token_dim=32"]  # fmt: skip


@pytest.mark.parametrize("algo", ["residual", "ppo"])
def test_gymnasium_task_from_a_robomimic_file(tmp_path: Path, compose, algo: str) -> None:
    demos = write_robomimic_file(tmp_path / "pendulum.hdf5", pendulum_episodes(4, steps=30))
    cfg = compose("train", [
        "env=gym", "env.id=InvertedPendulum-v5", "env.max_episode_steps=30", "env.num_envs=2",
        "env.vectorization=sync", f"bc.demos={demos}", "bc.epochs=2", "bc.batch_size=32",
        f"algo={algo}", "algo.iterations=1", "algo.n_steps=8", "algo.minibatch_size=8", "algo.update_epochs=1",
        *(["algo.residual_hidden=[16,16]"] if algo == "residual" else []), *TINY, "eval_episodes=2", "video_episodes=0", "log.progress=false",
        "log.tensorboard=false", f"cache_dir={tmp_path / 'cache'}",
    ])  # fmt: skip
    summary = train.main(cfg, tmp_path / "train")
    assert summary["checkpoint"].endswith("latest")  # what train prints is what evaluate takes
    assert summary["iterations"] == 1 and summary["env_steps"] > 0 and summary["learner"] == cfg.algo.learner
    # InvertedPendulum reports no is_success: returns, and no success rate that would read as "always fails"
    assert summary["bc_success_rate"] is None and summary["ppo_success_rate"] is None
    assert summary["bc_return"] > 0 and summary["ppo_return"] > 0
    (bc_root,) = (tmp_path / "cache" / "bc").glob("gym-*[!n]")  # the cached BC checkpoint, not its .run
    bc = checkpoint.load(bc_root)
    assert bc.extra["obs_spec"] == {"state": [4]} and bc.extra["action_dim"] == 1
    assert Path(bc.extra["demos"]).parent == tmp_path / "cache" / "demos"
    assert Path(bc.extra["demos"]).name.startswith("gym-import-")
    (tmp_path / "eval").mkdir()  # the run directory Hydra makes
    result = evaluate.main(
        EvaluateConfig(checkpoint=summary["checkpoint"], n_episodes=2, num_envs=2, video_episodes=0),
        tmp_path / "eval",
    )
    assert result["n_episodes"] == 2 and math.isfinite(result["mean_return"]) and result["mean_return"] > 0
    assert result["success_rate"] is None and result["failures"] is None
