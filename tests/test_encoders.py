"""Encoders: shapes, random shift, voxeliser against a looped reference, text cache, fusion subsets."""

import pytest
import torch

from diffpolicy.config import EncoderConfig
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.encoders.pointcloud import PointCloudEncoder, voxelize
from diffpolicy.encoders.rgb import RGBEncoder, random_shift
from diffpolicy.encoders.text import TextEncoder

D = 32
ENC = EncoderConfig(rgb_channels=[8, 16], rgb_keypoints=8, voxel_grid=8, voxel_channels=[8, 16], token_dim=D,
                    fusion_heads=2, state_hidden=32)  # fmt: skip
SPEC = {"rgb": (24, 24, 3), "points": (50, 3), "state": (5,), "instruction": None}


def obs(b: int = 2, to: int = 1) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "rgb": torch.randint(0, 256, (b, to, 24, 24, 3), dtype=torch.uint8, generator=g),
        "points": torch.rand(b, to, 50, 3, generator=g) * 0.6,
        "state": torch.randn(b, to, 5, generator=g),
        "instruction": ["pick the red cube", "pick the blue cube"][:b],
    }


def test_rgb_encoder_shapes_and_shift():
    enc = RGBEncoder([8, 16], keypoints=8, token_dim=D, shift=2)
    img = obs()["rgb"][:, 0]
    tok = enc(img)
    assert tok.shape == (2, enc.n_tokens, D) and enc.n_tokens == 4
    torch.testing.assert_close(tok, enc(img))  # no augmentation by default
    assert not torch.allclose(tok, enc(img, augment=True, generator=torch.Generator().manual_seed(3)))


def test_random_shift_against_loop():
    img = torch.randn(3, 2, 6, 5)
    g = torch.Generator().manual_seed(0)
    out = random_shift(img, 2, generator=g)
    shift = torch.randint(0, 5, (3, 2), generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(img, (2, 2, 2, 2), mode="replicate")
    for m in range(3):
        dy, dx = shift[m].tolist()
        torch.testing.assert_close(out[m], padded[m, :, dy : dy + 6, dx : dx + 5])


def test_voxelize_against_loop():
    G, low, high = 4, torch.tensor([-1.0, 0.0, 0.0]), torch.tensor([1.0, 2.0, 1.0])
    pts = torch.rand(3, 40, 3, generator=torch.Generator().manual_seed(1)) * 3 - 1  # some outside the box
    pts[0, 0] = float("nan")
    pts[1, 1] = torch.tensor([1.0, 0.5, 0.5])  # exactly on the upper x face: outside
    occ = voxelize(pts, low, high, G)
    ref = torch.zeros(3, 1, G, G, G)
    for m in range(3):
        for p in pts[m]:
            rel = (p - low) / (high - low) * G
            if torch.isfinite(rel).all() and (rel >= 0).all() and (rel < G).all():
                i, j, k = rel.long().tolist()
                ref[m, 0, i, j, k] = 1.0
    assert torch.equal(occ, ref) and occ.sum() > 0


def test_pointcloud_encoder_shapes():
    enc = PointCloudEncoder([8, 16], 8, ENC.workspace_low, ENC.workspace_high, D)
    assert enc(obs()["points"][:, 0]).shape == (2, 8, D)  # (8 / 4)^3 cells


def test_text_cache_hash_backend():
    enc = TextEncoder(D, backend="hash")
    e = enc(["a b", "c d", "a b"])
    assert e.shape == (3, 1, D) and enc.cache_misses == 2 and enc.cache_hits == 1
    enc(["c d"])
    assert enc.cache_misses == 2 and enc.cache_hits == 2
    assert [n for n, _ in enc.named_parameters()] == ["proj.weight", "proj.bias"]


def test_text_minilm_real():
    enc = TextEncoder(D, backend="minilm")
    emb = enc.embed(["pick up the red cube", "open the drawer", "pick up the red cube"])
    assert emb.shape == (3, 384) and torch.isfinite(emb).all()
    assert torch.equal(emb[0], emb[2]) and (emb[0] - emb[1]).norm() > 0.1
    assert enc.cache_misses == 2 and enc.cache_hits == 1
    enc.embed(["open the drawer"])
    assert enc.cache_misses == 2 and enc.cache_hits == 2
    # The MiniLM is outside the module tree: not trainable, not saved.
    assert set(enc.state_dict()) == {"proj.weight", "proj.bias"}
    assert all(not p.requires_grad for p in enc.backend.model.parameters())


@pytest.mark.parametrize(
    "keys", [("state",), ("rgb", "state"), ("points",), ("rgb", "points", "state", "instruction")]
)
def test_observation_encoder_subsets(keys):
    spec = {k: SPEC[k] for k in keys}
    enc = ObservationEncoder(ENC, spec, n_obs_steps=2, cond_dim=20, text_backend="hash")
    o = {k: v for k, v in obs(to=2).items() if k in keys}
    cond = enc(o)
    assert cond.shape == (2, 20)
    cond.sum().backward()
    assert all(p.grad is not None for n, p in enc.named_parameters() if "step_embed" in n)


def test_observation_encoder_respects_switches_and_history():
    cfg = EncoderConfig(**{**ENC.__dict__, "use_rgb": False, "use_text": False})
    enc = ObservationEncoder(cfg, SPEC, n_obs_steps=2, cond_dim=20, text_backend="hash")
    assert enc.modalities == ["points", "state"] and not enc.use_text
    o1, o2 = obs(to=1), obs(to=2)
    assert enc(o1).shape == enc(o2).shape == (2, 20)
    o3 = dict(o1, state=o1["state"][:, 0])  # missing To axis reads as To = 1
    torch.testing.assert_close(enc(o3), enc(o1))
    with pytest.raises(ValueError):
        enc(obs(to=3))


def test_text_changes_condition():
    enc = ObservationEncoder(ENC, SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash")
    o = obs()
    c1 = enc(o)
    c2 = enc(dict(o, instruction=["pick the blue cube", "pick the red cube"]))
    assert not torch.allclose(c1, c2, atol=1e-5)


def test_text_film_steers_the_rgb_features():
    """The instruction modulates the RGB feature maps: identity at initialisation, gradient into the FiLM
    layers, and once they are non-zero the RGB tokens depend on the text; the encoder refuses to run
    without it."""
    enc = RGBEncoder([8, 16], keypoints=8, token_dim=D, text_dim=D)
    x = enc.preprocess(obs()["rgb"][:, 0])
    text = torch.randn(2, D)
    torch.testing.assert_close(enc.tokens(x, text), RGBEncoder.tokens(enc, x, torch.zeros(2, D)))
    enc.tokens(x, text).square().sum().backward()
    assert all(lin.weight.grad.abs().sum() > 0 for lin in enc.text_film)
    with torch.no_grad():
        for lin in enc.text_film:
            lin.weight.normal_(0.0, 0.3)
    assert not torch.allclose(enc.tokens(x, text), enc.tokens(x, -text), atol=1e-4)
    with pytest.raises(ValueError, match="text-conditioned"):
        enc.tokens(x)
    # In the observation encoder only when RGB and text are both used, and switchable off.
    assert ObservationEncoder(ENC, SPEC, 1, 20, text_backend="hash").encoders["rgb"].text_film is not None
    off = EncoderConfig(**{**ENC.__dict__, "text_film": False})
    assert ObservationEncoder(off, SPEC, 1, 20, text_backend="hash").encoders["rgb"].text_film is None
    no_text = {k: v for k, v in SPEC.items() if k != "instruction"}
    assert ObservationEncoder(ENC, no_text, 1, 20).encoders["rgb"].text_film is None


def test_encoder_grad_checkpointing_same_gradients():
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        enc = ObservationEncoder(ENC, SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash").train()
        enc.grad_checkpointing = ckpt
        enc(obs()).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in enc.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])
