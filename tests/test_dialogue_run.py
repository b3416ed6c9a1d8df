"""A tiny dialogue run end to end (issue 62): env=mujoco_dialogue composes the instruction memory, BC trains
on corrected demonstrations, and evaluation reports success per episode kind, also under held-out phrasings
and reading the latest utterance only."""

from __future__ import annotations

import pytest
import torch

from diffpolicy.cli import compose
from diffpolicy.encoders.memory import InstructionMemory

TINY = [
    "env=mujoco_dialogue",
    "env.num_envs=3",
    "env.vectorization=sync",
    "env.image_size=32",
    "env.n_points=64",
    "env.max_episode_steps=100",
    "policy.down_dims=[16,32]",
    "policy.cond_dim=16",
    "policy.step_embed_dim=16",
    "policy.ddim_steps=2",
    "policy.encoder.rgb_channels=[8]",
    "policy.encoder.rgb_keypoints=4",
    "policy.encoder.point_channels=[8]",
    "policy.encoder.point_keypoints=4",
    "policy.encoder.token_dim=16",
    "policy.encoder.fusion_heads=2",
    "bc.n_demos=3",
    "bc.epochs=1",
    "bc.batch_size=16",
    "bc.mask_unheard=true",
    "eval_episodes=6",
    "val_episodes=3",
    "log.progress=false",
    "device=cpu",
]


def test_env_mujoco_dialogue_composes_the_memory():
    cfg = compose("pretrain", ["env=mujoco_dialogue"])
    assert cfg.env.id == "diffpolicy_envs:MujocoDialogue-v0" and cfg.env.obs_mode == "multimodal"
    assert cfg.policy.encoder.text_memory == 2 and cfg.eval_protocol == "noise_free"
    assert cfg.policy.encoder.text_standardize and cfg.bc.mask_unheard
    assert not compose("pretrain", ["env=mujoco_pick"]).bc.mask_unheard
    assert compose("pretrain", ["env=mujoco_pick"]).policy.encoder.text_memory == 0


@pytest.fixture(scope="module")
def dialogue_run(tmp_path_factory):
    import os

    from diffpolicy.pretrain import main

    os.environ["DIFFPOLICY_TEXT_ENCODER"] = "hash"  # no MiniLM needed for the wiring
    root = tmp_path_factory.mktemp("dialogue")
    cfg = compose("pretrain", [*TINY, f"cache_dir={root / 'cache'}"])
    summary = main(cfg, root / "run")
    yield root, summary
    os.environ.pop("DIFFPOLICY_TEXT_ENCODER", None)


def test_the_saved_policy_standardises_with_the_demonstrations_statistics(dialogue_run):
    from diffpolicy.policy_io import load_policy

    _, summary = dialogue_run
    policy, _, _ = load_policy(summary["checkpoint"], "cpu")
    text = policy.obs_encoder.text.text
    assert text.standardize and not torch.equal(text.embed_std, torch.ones_like(text.embed_std))


def test_pretrain_reports_each_episode_kind(dialogue_run):
    _, summary = dialogue_run
    kinds = summary["by_kind"]
    assert set(kinds) <= {"none", "object", "place"} and sum(v["episodes"] for v in kinds.values()) == 6
    for kind, v in kinds.items():
        assert 0.0 <= v["success_rate"] <= 1.0 and len(v["success_ci"]) == 2
        split = [v[k]["episodes"] for k in ("holding", "not_holding") if k in v]
        assert sum(split) == (v["episodes"] if kind != "none" else 0)  # a correction was held or not
    assert sum(v["episodes"] for v in summary["val"]["by_kind"].values()) == 3  # choices read these


@pytest.mark.parametrize("env_kwargs", [{"dialogue_view": "latest"}, {"phrasings": "heldout"}])
def test_evaluate_the_checkpoint_under_another_view_of_the_dialogue(dialogue_run, env_kwargs):
    from diffpolicy import evaluate
    from diffpolicy.config import EvaluateConfig
    from diffpolicy.policy_io import load_policy

    root, _ = dialogue_run
    ckpt = root / "run" / "checkpoints"
    policy, env_cfg, _ = load_policy(ckpt, "cpu")
    assert isinstance(policy.obs_encoder.text, InstructionMemory) and env_cfg.name == "mujoco_dialogue"
    cfg = EvaluateConfig(checkpoint=str(ckpt), n_episodes=3, env_kwargs=env_kwargs)
    run_dir = root / f"eval_{'_'.join(env_kwargs)}"
    run_dir.mkdir()
    summary = evaluate.main(cfg, run_dir)
    assert (
        summary["env_kwargs"] == env_kwargs and sum(v["episodes"] for v in summary["by_kind"].values()) == 3
    )


def test_evaluate_writes_a_gif_of_a_corrected_episode(dialogue_run):
    from diffpolicy import evaluate
    from diffpolicy.config import EvaluateConfig

    root, _ = dialogue_run
    cfg = EvaluateConfig(checkpoint=str(root / "run" / "checkpoints"), n_episodes=1, video_episodes=1,
                         video_format="gif", env_kwargs={"kinds": ["object"], "correction_steps": [2, 2]})  # fmt: skip
    run_dir = root / "eval_gif"
    run_dir.mkdir()
    summary = evaluate.main(cfg, run_dir)
    assert summary["video"] == str(run_dir / "eval.gif") and (run_dir / "eval.gif").stat().st_size > 0
