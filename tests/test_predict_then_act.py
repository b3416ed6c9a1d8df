"""Predict-then-act (``policy.encoder.predict_positions``): perception predicts positions, the denoiser's
condition reads proprioception, those positions and the instruction only; BC teaches the condition on noised
labels and the prediction on the labels."""

import pytest
import torch

from diffpolicy.bc import bc_losses, behaviour_cloning, target_head
from diffpolicy.config import BCConfig, DeviceConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.demos import collect_demos
from diffpolicy.device import Runtime
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.logger import Logger, read_metrics
from diffpolicy.policy_io import build_policy, load_policy

D = 16
ENC = EncoderConfig(rgb_channels=[8], rgb_keypoints=4, point_channels=[8], point_keypoints=4, token_dim=D,
                    fusion_heads=2, state_hidden=16, predict_positions=2)  # fmt: skip
SPEC = {"rgb": (24, 24, 3), "points": (50, 6), "state": (5,), "instruction": None}
POLICY = PolicyConfig(encoder=ENC, cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=16,
                      n_action_steps=8, train_timesteps=20, ddim_steps=4)  # fmt: skip


def obs(b: int = 4, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "rgb": torch.randint(0, 256, (b, 1, 24, 24, 3), dtype=torch.uint8, generator=g),
        "points": torch.rand(b, 1, 50, 6, generator=g) * 0.6,
        "state": torch.randn(b, 1, 5, generator=g),
        "instruction": ["push the puck to the goal"] * b,
    }


def encoder(seed: int = 0) -> ObservationEncoder:
    torch.manual_seed(seed)
    enc = ObservationEncoder(ENC, SPEC, 1, 16, text_backend="hash")
    enc.state_normalizer.fit(torch.randn(64, 5))
    return enc.eval()


def test_config_validates_the_fields() -> None:
    with pytest.raises(ValueError, match="predict_positions"):
        EncoderConfig(predict_positions=-1)
    with pytest.raises(ValueError, match="position_noise"):
        EncoderConfig(position_noise=-0.01)
    assert not hasattr(ObservationEncoder(EncoderConfig(token_dim=D, fusion_heads=2), SPEC, 1, 16,
                                          text_backend="hash"), "position_head")  # fmt: skip


def test_the_condition_reads_positions_not_the_scene() -> None:
    """Given positions, perception is not run: another image and cloud give the same condition; other
    positions, another proprioception give another."""
    enc = encoder()
    o, other = obs(seed=0), obs(seed=1)
    pos = torch.rand(4, 6) * 0.5
    cond = enc(o, positions=pos)
    assert cond.shape == (4, 16)
    scene_swapped = {**o, "rgb": other["rgb"], "points": other["points"]}
    torch.testing.assert_close(enc(scene_swapped, positions=pos), cond)
    assert not torch.allclose(enc(o, positions=pos + 0.05), cond)
    assert not torch.allclose(enc({**o, "state": other["state"]}, positions=pos), cond)
    with pytest.raises(ValueError, match="predicts 2 xyz"):
        enc(o, positions=pos[:, :3])


def test_acting_uses_the_predicted_positions() -> None:
    """Without positions the condition is the one of the positions perception predicts (in m, round-tripped
    through the workspace box), and it changes with the scene."""
    enc = encoder()
    o = obs()
    pred = enc.predict_positions(o)
    assert pred.shape == (4, 6)
    torch.testing.assert_close(enc(o), enc(o, positions=pred), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(enc(o), enc({**o, "points": obs(seed=1)["points"]}))


def test_position_loss_against_an_independent_reference() -> None:
    enc = encoder()
    o = obs()
    target = torch.rand(4, 6) * 0.5
    loss, error = enc.position_loss(o, target)
    pred = enc.predict_positions(o)  # m
    span = (torch.tensor(ENC.workspace_high) - torch.tensor(ENC.workspace_low)).repeat(2)
    want = (((pred - target) / span * 2) ** 2).mean()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-4)
    dist = (pred - target).view(4, 2, 3).norm(dim=-1).mean()
    torch.testing.assert_close(error, dist, atol=1e-5, rtol=1e-4)
    zero, err0 = enc.position_loss(o, pred.detach())
    assert float(zero.detach()) < 1e-10 and float(err0) < 1e-5


class _Labelled:
    """A dataset stand-in: ``target`` rows of ``width`` values."""

    def __init__(self, width: int) -> None:
        self.width = width

    def target(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(idx), self.width)


def test_target_head_checks_the_label_and_the_weight() -> None:
    """The policy's own head replaces BC's: no separate head; a label of another size, or no weight on the
    prediction, fails before training with what to change."""
    assert target_head(_Labelled(6), POLICY, BCConfig(target_aux_weight=1.0), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="holds 1 positions"):
        target_head(_Labelled(3), POLICY, BCConfig(target_aux_weight=1.0), torch.device("cpu"))
    with pytest.raises(ValueError, match="target_aux_weight > 0"):
        target_head(_Labelled(6), POLICY, BCConfig(target_aux_weight=0.0), torch.device("cpu"))


def test_bc_step_direction() -> None:
    """On a fixed batch: the BC loss reaches the denoiser and the condition MLP but never perception (its
    condition reads the labels), the position loss reaches perception; a few steps lower both."""
    torch.manual_seed(0)
    policy = build_policy(POLICY, SPEC, 3, text_backend="hash")
    policy.fit_normalizers(actions=torch.rand(64, 3) * 2 - 1, state=torch.randn(64, 5))
    policy.train()
    o, actions, target = obs(8), torch.rand(8, 16, 3) * 2 - 1, torch.rand(8, 6) * 0.5
    bc = BCConfig(target_aux_weight=1.0)
    loss, aux_loss, _ = bc_losses(policy, None, o, actions, target, bc, torch.Generator().manual_seed(0))
    loss.backward()
    perception = policy.obs_encoder.encoders["points"]
    assert all(p.grad is None for p in perception.parameters())
    assert all(p.grad is None for p in policy.obs_encoder.position_head.parameters())
    # the condition MLP is in the BC loss's graph (its gradient may start at zero: the U-Net's FiLM is
    # zero-initialised)
    assert all(p.grad is not None for p in policy.obs_encoder.act_head.parameters())
    policy.zero_grad(set_to_none=True)
    aux_loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in perception.parameters())
    assert all(p.grad is None for p in policy.denoiser.parameters())

    optim = torch.optim.Adam(policy.parameters(), lr=3e-3)
    first = None
    for step in range(40):
        gen = torch.Generator().manual_seed(step % 2)  # two fixed noise draws
        loss, aux_loss, _ = bc_losses(policy, None, o, actions, target, bc, gen)
        optim.zero_grad(set_to_none=True)
        (loss + aux_loss).backward()
        optim.step()
        first = first or (float(loss.detach()), float(aux_loss.detach()))
    assert float(aux_loss.detach()) < 0.3 * first[1]
    assert float(loss.detach()) < first[0]


def test_multimodal_bc_predicts_then_acts(tmp_path) -> None:
    """Multimodal BC on the pick task's demonstrations (its label: the named cube's position, k = 1): the
    position error is logged, the head and condition MLP are saved with the policy, and the loaded policy
    acts from its own prediction."""
    env = EnvConfig(image_size=32, n_points=64, num_envs=2)
    demos = collect_demos(env, 1, 0, tmp_path / "pick")["path"]
    policy_cfg = PolicyConfig(
        encoder=EncoderConfig(rgb_channels=[8], rgb_keypoints=4, point_channels=[8], point_keypoints=4,
                              token_dim=16, fusion_heads=2, state_hidden=16, predict_positions=1),
        cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=16, n_action_steps=8,
        train_timesteps=20, ddim_steps=4,
    )  # fmt: skip
    cpu = Runtime.from_config(DeviceConfig(type="cpu"))
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        _, metrics = behaviour_cloning(
            env, policy_cfg, BCConfig(epochs=2, batch_size=16, target_aux_weight=1.0), demos, cpu, log,
            tmp_path, 0, text_backend="hash",
        )  # fmt: skip
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "losses/target_aux" in r]
    assert rows and all(0 < r["train/target_error_cm"] < 200 for r in rows)
    loaded, _, ckpt = load_policy(metrics["checkpoint"])
    assert any(k.startswith("obs_encoder.position_head.") for k in ckpt.state["policy"])
    assert loaded.cfg.encoder.predict_positions == 1
    from diffpolicy.data.windows import DemoWindows

    batch, _ = DemoWindows(demos, 1, 16).batch(torch.arange(2), torch.device("cpu"))
    out = loaded.sample(batch, deterministic=True)
    assert out.actions.shape[:2] == (2, 16) and bool(torch.isfinite(out.actions).all())
    # acting reads the prediction: the condition equals the one built from the predicted positions
    with torch.no_grad():
        pred = loaded.obs_encoder.predict_positions(batch)
        torch.testing.assert_close(
            loaded.encode(batch), loaded.encode(batch, positions=pred), atol=1e-5, rtol=1e-5
        )


def test_the_position_normaliser_keeps_a_floor_on_each_range() -> None:
    """A coordinate the demonstrations barely vary (a goal's height) is read on at least 5 cm, so that a
    millimetre of perception error stays a small fraction of a unit; wide coordinates keep their range."""
    from diffpolicy.normalizer import MinMaxNormalizer

    data = torch.tensor([[0.0, 0.300], [0.2, 0.301]])
    norm = MinMaxNormalizer(2).fit(data, min_span=0.05)
    torch.testing.assert_close(norm.low, torch.tensor([0.0, 0.3005 - 0.025]))
    torch.testing.assert_close(norm.high, torch.tensor([0.2, 0.3005 + 0.025]))
    moved = norm.normalize(torch.tensor([[0.1, 0.3015]])) - norm.normalize(torch.tensor([[0.1, 0.3005]]))
    assert abs(float(moved[0, 1]) - 0.04) < 1e-4  # 1 mm of 5 cm: 0.04 of the [-1, 1] range
    torch.testing.assert_close(MinMaxNormalizer(2).fit(data).high, data.max(0).values)  # no floor by default
    policy = build_policy(POLICY, SPEC, 3, text_backend="hash")
    policy.fit_normalizers(positions=torch.rand(20, 6) * 0.001)
    span = policy.obs_encoder.position_normalizer.high - policy.obs_encoder.position_normalizer.low
    torch.testing.assert_close(span, torch.full((6,), 0.05))


def test_filtered_bc_trains_a_predict_then_act_policy_on_the_labels() -> None:
    """A filtered_bc round on demonstrations and kept rollout windows that carry the privileged label: the
    position head is trained on it (the EMA policy's prediction error falls), as BC trains it. A round that
    ignored the label would leave the head to whatever the action loss does to it."""
    import copy
    from types import SimpleNamespace

    import numpy as np

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.data.dataset import TARGET_KEY
    from diffpolicy.distributed import DistInfo
    from diffpolicy.rl.filtered_bc import FilteredBCLearner, WindowStore

    class Demos(WindowStore):
        """Demonstration windows whose label is read apart, as :class:`DemoWindows` gives it."""

        has_target = True

        def batch(self, idx, device):
            o, a = super().batch(idx, device)
            return {k: v for k, v in o.items() if k != TARGET_KEY}, a

        def target(self, idx, device="cpu"):
            return super().batch(idx, device)[0][TARGET_KEY][:, 0]

    def episode(seed: int) -> list:
        o = obs(3, seed)
        labels = torch.rand(3, 6, generator=torch.Generator().manual_seed(seed)) * 0.5
        return [
            ({"rgb": o["rgb"][i, 0].numpy(), "points": o["points"][i, 0].numpy(), "state": o["state"][i, 0].numpy(),
              "instruction": o["instruction"][i], TARGET_KEY: labels[i].numpy()}, np.full((8, 3), 0.1, np.float32))
            for i in range(3)
        ]  # fmt: skip

    torch.manual_seed(0)
    policy = build_policy(POLICY, SPEC, 3, text_backend="hash")
    policy.fit_normalizers(actions=torch.rand(64, 3) * 2 - 1, state=torch.randn(64, 5),
                           positions=torch.rand(64, 6) * 0.5)  # fmt: skip
    learner = object.__new__(FilteredBCLearner)
    learner.cfg = SimpleNamespace(algo=FilteredBCConfig(bc_steps=60, lr=3e-3, batch_size=6, keep="success"),
                                  bc=BCConfig(target_aux_weight=1.0, batch_size=6, ema_decay=0.5))  # fmt: skip
    learner.rt, learner.info, learner.logger = Runtime.from_config(DeviceConfig(type="cpu")), DistInfo(), None
    learner.policy, learner.model = policy.eval(), copy.deepcopy(policy).train()
    learner.params = [p for p in learner.model.parameters() if p.requires_grad]
    learner.optim = torch.optim.AdamW(learner.params, lr=3e-3)
    learner.labelled, learner._added = True, 3
    learner.demos, learner.kept = Demos(16), WindowStore(16)
    learner.demos.add_episode(episode(0))
    learner.kept.add_episode(episode(1))  # a kept rollout: its windows hold the label the env reported

    def error() -> float:
        errors = []
        for store in (learner.demos, learner.kept):
            o, _ = WindowStore.batch(store, torch.arange(3), torch.device("cpu"))
            label = o.pop(TARGET_KEY)[:, 0]
            with torch.no_grad():
                errors.append(float((learner.policy.obs_encoder.predict_positions(o) - label).abs().mean()))
        return sum(errors) / 2

    before = error()
    metrics = learner.update(seed=0, step=0, iteration=0)
    assert np.isfinite(metrics["losses/bc"]) and metrics["train/kept_windows"] == 3
    assert error() < 0.5 * before


POINTS_ENC = EncoderConfig(rgb_channels=[8], rgb_keypoints=4, point_channels=[8], point_keypoints=4, token_dim=D,
                           fusion_heads=2, state_hidden=16, predict_positions=2, position_head="points")  # fmt: skip


def test_point_position_head_against_a_looped_reference() -> None:
    """Each position is the softmax-weighted mean of the points (the logits a linear map of the features
    plus the text query's bilinear term) plus its offset, in box units; the loss and error as the fused
    head's."""
    from diffpolicy.encoders.fusion import PointPositionHead

    torch.manual_seed(0)
    head = PointPositionHead(8, [-1.0, -1.0, 0.0], [1.0, 1.0, 1.0], points=2, text_dim=4)
    with torch.no_grad():
        head.offset.copy_(torch.randn(2, 3) * 0.1)
    h, xyz, text = torch.randn(3, 20, 8), torch.rand(3, 20, 3) * 2 - 1, torch.randn(3, 4)
    got = head.box(h, xyz, text)
    want = torch.empty(3, 2, 3)
    for b in range(3):
        q = head.text_query(text[b]).view(2, 8)
        for j in range(2):
            logit = torch.stack([head.logits(h[b, i])[j] + h[b, i] @ q[j] / 8**0.5 for i in range(20)])
            w = torch.exp(logit - logit.max())
            want[b, j] = (w[:, None] * xyz[b]).sum(0) / w.sum() + head.offset[j]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    metres = head.predict(h, xyz, text)  # (3, 6): box units -> m on x in [-1, 1], z in [0, 1]
    torch.testing.assert_close(metres.view(3, 2, 3)[..., 2], (want[..., 2] + 1) / 2, atol=1e-5, rtol=1e-5)
    loss, error = head(h, xyz, text, metres.detach())
    assert float(loss.detach()) < 1e-10 and float(error) < 1e-5


def test_point_head_reads_the_cloud_and_moves_with_it() -> None:
    """position_head=points: the prediction (zero offset) lies within the cloud's extent, another cloud gives
    another one, the image does not move it; the BC position loss trains the point encoder, never the RGB
    encoder; a policy without points cannot take it."""
    torch.manual_seed(0)
    enc = ObservationEncoder(POINTS_ENC, SPEC, 1, 16, text_backend="hash")
    enc.state_normalizer.fit(torch.randn(64, 5))
    o = obs()
    pred = enc.predict_positions(o).view(4, 2, 3)
    pts = o["points"][:, 0, :, :3]
    assert bool(
        (pred >= pts.amin(1, keepdim=True) - 1e-5).all() and (pred <= pts.amax(1, keepdim=True) + 1e-5).all()
    )
    other = obs(seed=1)
    assert not torch.allclose(enc.predict_positions({**o, "points": other["points"]}), pred.flatten(1))
    torch.testing.assert_close(enc.predict_positions({**o, "rgb": other["rgb"]}), pred.flatten(1))
    torch.testing.assert_close(enc(o), enc(o, positions=pred.flatten(1)), atol=1e-5, rtol=1e-5)
    loss, _ = enc.position_loss(o, torch.rand(4, 6) * 0.5)
    loss.backward()
    assert all(p.grad is None for p in enc.encoders["rgb"].parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.encoders["points"].parameters())
    with pytest.raises(ValueError, match="needs the points modality"):
        ObservationEncoder(POINTS_ENC, {"rgb": (24, 24, 3), "state": (5,)}, 1, 16, text_backend="hash")
    with pytest.raises(ValueError, match="position_head"):
        EncoderConfig(position_head="grid")


def test_point_head_bc_steps_lower_the_position_error() -> None:
    """Direction: on a fixed batch, BC steps with the point head bring its positions to the labels."""
    torch.manual_seed(0)
    cfg = PolicyConfig(**{**POLICY.__dict__, "encoder": POINTS_ENC})
    policy = build_policy(cfg, SPEC, 3, text_backend="hash")
    policy.fit_normalizers(actions=torch.rand(64, 3) * 2 - 1, state=torch.randn(64, 5),
                           positions=torch.rand(64, 6) * 0.5)  # fmt: skip
    policy.train()
    o, actions = obs(8), torch.rand(8, 16, 3) * 2 - 1
    target = o["points"][:, 0, :2, :3].flatten(1) + 0.02  # two of each cloud's points, moved 2 cm
    optim = torch.optim.Adam(policy.parameters(), lr=1e-2)
    bc = BCConfig(target_aux_weight=1.0)
    errors = []
    for _ in range(60):
        loss, aux_loss, error = bc_losses(
            policy, None, o, actions, target, bc, torch.Generator().manual_seed(0)
        )
        optim.zero_grad(set_to_none=True)
        (loss + aux_loss).backward()
        optim.step()
        errors.append(float(error))
    assert errors[-1] < 0.7 * errors[0]
