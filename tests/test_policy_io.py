"""policy_io: a saved policy reloads to the same actions; mismatched or corrupt checkpoints fail in one line."""

import dataclasses
import json

import pytest
import torch

from diffpolicy.checkpoint import META, TENSORS, CheckpointError
from diffpolicy.config import EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.policy_io import build_policy, load_policy, save_policy

DA, TA, TE = 7, 16, 4
ENC = EncoderConfig(rgb_channels=[8], rgb_keypoints=4, point_channels=[8], point_keypoints=4, token_dim=16,
                    fusion_heads=2, state_hidden=16)  # fmt: skip
SPEC = {"rgb": [16, 16, 3], "points": [32, 3], "state": [13], "instruction": []}
ENV = EnvConfig(image_size=16, n_points=32, num_envs=2)


def policy_cfg(**kw) -> PolicyConfig:
    base = dict(encoder=ENC, cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=TA,
                n_action_steps=TE, train_timesteps=50, ddim_steps=5, gaussian_hidden=[32])  # fmt: skip
    return PolicyConfig(**{**base, **kw})


def obs(b: int = 3) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "rgb": torch.randint(0, 256, (b, 1, 16, 16, 3), dtype=torch.uint8, generator=g),
        "points": torch.rand(b, 1, 32, 3, generator=g) * 0.5,
        "state": torch.randn(b, 1, 13, generator=g),
        "instruction": ["put the red cube in the tray", "move the blue block to the tray", "x"][:b],
    }


def trained(kind: str = "diffusion"):
    torch.manual_seed(0)
    cfg = policy_cfg(kind=kind)
    p = build_policy(cfg, SPEC, DA, text_backend="hash")
    p.fit_normalizers(actions=torch.rand(50, DA) * 3 - 1, state=torch.randn(50, 13) * 2)
    with torch.no_grad():  # move away from the initialisation so a fresh policy would differ
        for prm in p.parameters():
            prm.add_(0.01 * torch.randn_like(prm))
    return p, cfg


@pytest.mark.parametrize("kind", ["diffusion", "gaussian"])
def test_roundtrip_same_actions(tmp_path, kind):
    p, cfg = trained(kind)
    path = save_policy(tmp_path / "ckpt", 7, p, env_cfg=ENV, policy_cfg=cfg, metrics={"losses/bc": 0.5})
    q, env_cfg, ckpt = load_policy(tmp_path / "ckpt", "cpu", env_overrides={"num_envs": 5})
    assert ckpt.path == path and ckpt.step == 7 and ckpt.metrics == {"losses/bc": 0.5}
    assert env_cfg == dataclasses.replace(ENV, num_envs=5)
    assert ckpt.extra["obs_spec"] == SPEC and ckpt.extra["action_dim"] == DA
    assert ckpt.extra["text_backend"] == "hash" and not q.training
    p.eval()
    noise = torch.randn(3, TA, DA, generator=torch.Generator().manual_seed(3))
    for det in (True, False):
        a = p.sample(obs(), noise=noise, deterministic=det, generator=torch.Generator().manual_seed(4))
        b = q.sample(obs(), noise=noise, deterministic=det, generator=torch.Generator().manual_seed(4))
        assert torch.equal(a.actions, b.actions)


def test_extra_state_and_obs_spec_required(tmp_path):
    p, cfg = trained()
    save_policy(tmp_path / "c", 1, p, env_cfg=ENV, policy_cfg=cfg, extra_state={"ema": {"n": torch.ones(2)}},
                extra={"key": "abc"})  # fmt: skip
    _, _, ckpt = load_policy(tmp_path / "c")
    assert torch.equal(ckpt.state["ema"]["n"], torch.ones(2)) and ckpt.extra["key"] == "abc"
    with pytest.raises(ValueError, match="policy"):
        save_policy(tmp_path / "d", 1, p, env_cfg=ENV, policy_cfg=cfg, extra_state={"policy": {}})


def _edit_meta(ckpt_dir, fn) -> None:
    meta = json.loads((ckpt_dir / META).read_text())
    fn(meta)
    (ckpt_dir / META).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["config"]["policy"].update(down_dims=[32, 64]), "does not match the policy"),
        (lambda m: m["config"]["policy"].update(new_knob=1), "unknown fields"),
        (lambda m: m["config"]["policy"]["encoder"].pop("token_dim"), "lacks fields"),
        (lambda m: m["config"]["env"].pop("obs_mode"), "lacks fields"),
        (lambda m: m["config"]["policy"].update(kind="transformer"), "invalid"),
        (lambda m: m["extra"].pop("obs_spec"), "obs_spec"),
        (lambda m: m["config"].pop("env"), "config\\['env'\\]"),
        (lambda m: m["extra"]["obs_spec"].pop("rgb"), "does not match the policy"),
    ],
)
def test_mismatched_config_is_one_line_error(tmp_path, edit, match):
    p, cfg = trained()
    path = save_policy(tmp_path / "c", 1, p, env_cfg=ENV, policy_cfg=cfg)
    _edit_meta(path, edit)
    with pytest.raises(CheckpointError, match=match) as exc:
        load_policy(path)
    assert "\n" not in str(exc.value)


def test_deploy_loading_takes_defaults_for_fields_an_older_checkpoint_lacks(tmp_path):
    """load_policy(deploy=True), for serving and export, needs no env config and fills missing fields."""
    p, cfg = trained()
    path = save_policy(tmp_path / "c", 1, p, env_cfg=ENV, policy_cfg=dataclasses.replace(cfg, compile=True))

    def older(m):
        m["config"].pop("env")
        m["config"]["policy"].pop("kernel_size")  # at its default
        m["config"].pop("sampling")  # how chains were sampled: the default sampling then holds

    _edit_meta(path, older)
    with pytest.raises(CheckpointError):
        load_policy(path)  # the training loader wants the whole record
    q, env_cfg, ckpt = load_policy(path, text_backend="hash", deploy=True)
    assert env_cfg is None and ckpt.extra["obs_spec"] == SPEC
    assert q.cfg.kernel_size == PolicyConfig().kernel_size and not q.cfg.compile
    assert q.sampling == {"ft_steps": cfg.ddim_steps, "eta": 1.0, "min_std": 0.01, "noise_scale": 1.0}
    g = torch.Generator().manual_seed(0)
    a = p.eval().sample(obs(), deterministic=True, generator=g).actions
    b = q.sample(obs(), deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    torch.testing.assert_close(a, b)
    _edit_meta(path, lambda m: m["config"]["policy"].update(new_knob=1))
    with pytest.raises(CheckpointError, match="unknown fields"):
        load_policy(path, text_backend="hash", deploy=True)


def test_corrupt_or_missing_checkpoint(tmp_path):
    p, cfg = trained()
    path = save_policy(tmp_path / "c", 1, p, env_cfg=ENV, policy_cfg=cfg)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_policy(tmp_path / "nowhere")
    data = bytearray((path / TENSORS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / TENSORS).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_policy(path)
    (path / META).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_policy(tmp_path / "c")


def test_a_checkpoint_written_before_blank_text_loads_with_its_default(tmp_path):
    """policy.encoder.blank_text is newer than some checkpoints: one that lacks it loads (False); setting it
    changes the BC cache key."""
    from diffpolicy.bc import bc_key
    from diffpolicy.config import BCConfig

    p, cfg = trained()
    path = save_policy(tmp_path / "c", 1, p, env_cfg=ENV, policy_cfg=cfg)
    _edit_meta(path, lambda m: m["config"]["policy"]["encoder"].pop("blank_text"))
    q, _, _ = load_policy(path)
    assert q.cfg.encoder.blank_text is False
    bc = BCConfig(epochs=1, batch_size=8, n_demos=1)
    blank = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, blank_text=True))
    assert bc_key(ENV, blank, bc, 0) != bc_key(ENV, cfg, bc, 0)
