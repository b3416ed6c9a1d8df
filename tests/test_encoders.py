"""Encoders: shapes, random shift, point keypoints, text cache, fusion subsets, the instruction selecting a cube."""

import pytest
import torch

from diffpolicy.config import EncoderConfig
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.encoders.pointcloud import PointCloudEncoder
from diffpolicy.encoders.rgb import RGBEncoder, random_shift
from diffpolicy.encoders.text import TextEncoder

D = 32
ENC = EncoderConfig(rgb_channels=[8, 16], rgb_keypoints=8, point_channels=[8, 16], point_keypoints=4, token_dim=D,
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


def test_pointcloud_encoder_shapes_and_keypoints():
    enc = PointCloudEncoder([8, 16], ENC.workspace_low, ENC.workspace_high, D, keypoints=8, keypoint_tokens=4)
    pts = obs()["points"][:, 0]  # (2, 50, 3): an uncoloured cloud is accepted
    assert enc(pts).shape == (2, 1 + 4, D)
    coloured = torch.cat([pts, torch.rand(2, 50, 3)], dim=-1)
    tok = enc(coloured)
    assert tok.shape == (2, 5, D)
    # Permutation invariant: the max-pool and the keypoint softmax are set functions of the points.
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(enc(coloured[:, perm]), tok, atol=1e-5, rtol=1e-5)
    assert PointCloudEncoder([8], ENC.workspace_low, ENC.workspace_high, D, keypoints=0).n_tokens == 1


def _cube_scenes(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 48, 6) clouds of three 16-point cubes (red, green, blue) at random places; (n, 3, 3) their centres."""
    centres = torch.rand(n, 3, 3, generator=g) * 0.6 + torch.tensor([0.05, -0.3, 0.0])  # (n, cube, xyz)
    offsets = (torch.rand(n, 3, 16, 3, generator=g) - 0.5) * 0.04
    xyz = (centres[:, :, None] + offsets).reshape(n, 48, 3)
    rgb = torch.eye(3).repeat_interleave(16, dim=0).expand(n, 48, 3)
    return torch.cat([xyz, rgb], dim=-1), centres


def test_instruction_selects_the_cube_in_the_point_features():
    """Trained briefly to report the named cube's position from points + instruction, the encoder answers
    differently for different names on the same cloud: each answer lies near the cube it was asked for.
    Ignoring the instruction it could not do better than the centroid of the three cubes."""
    torch.manual_seed(0)
    cfg = EncoderConfig(**{**ENC.__dict__, "point_channels": [32, 32], "point_keypoints": 4})
    spec = {"points": (48, 6), "instruction": None}
    enc = ObservationEncoder(cfg, spec, n_obs_steps=1, cond_dim=3, text_backend="hash")
    opt = torch.optim.Adam(enc.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    names = ["red", "green", "blue"]
    for _ in range(300):
        pts, centres = _cube_scenes(64, g)
        target = torch.randint(0, 3, (64,), generator=g)
        out = enc({"points": pts, "instruction": [f"pick the {names[i]} cube" for i in target.tolist()]})
        loss = (out - centres[torch.arange(64), target]).square().sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    pts, centres = _cube_scenes(32, torch.Generator().manual_seed(2))
    with torch.no_grad():
        errors = []
        for i, name in enumerate(names):
            out = enc({"points": pts, "instruction": [f"pick the {name} cube"] * 32})
            errors.append((out - centres[:, i]).norm(dim=-1))  # (32,) m
        errors = torch.stack(errors)  # (3, 32)
    centroid_error = (centres.mean(1, keepdim=True) - centres).norm(dim=-1).mean()
    assert errors.mean() < 0.3 * centroid_error, (errors.mean(), centroid_error)
    assert errors.mean() < 0.05  # m


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


def test_text_standardisation_against_reference():
    sentences = ["put the red cube in the yellow tray", "place the blue cube into the purple tray",
                 "move the green block to the yellow tray", "put the red cube in the yellow tray"]  # fmt: skip
    enc = TextEncoder(D, backend="hash", standardize=True)
    emb = enc.embed(sentences)
    torch.testing.assert_close(enc(sentences)[:, 0], enc.proj(emb))  # unfitted: the identity
    enc.fit(sentences)
    distinct = emb[:3]  # each distinct sentence once
    std = distinct.std(0)
    z = (distinct - distinct.mean(0)) / std.clamp_min(0.1 * std.mean())
    torch.testing.assert_close(enc(sentences[:3])[:, 0], enc.proj(z))
    assert set(enc.state_dict()) == {"proj.weight", "proj.bias", "embed_mean", "embed_std"}
    with pytest.raises(ValueError, match="2 distinct"):
        enc.fit(["a", "a"])
    plain = TextEncoder(D, backend="hash")
    plain.fit(sentences)  # no-op without standardize
    assert set(plain.state_dict()) == {"proj.weight", "proj.bias"}


def test_standardised_instruction_tells_the_colours_apart_sooner():
    """MiniLM's embeddings of one task's instructions share most of their direction: a linear read-out of the
    object's and the place's colour barely leaves chance in 100 AdamW steps on the raw embedding; standardised
    (the encoder's fit on the training phrasings) it separates them, and on a phrasing never fitted too."""
    templates = ["put the {o} cube in the {p} tray", "place the {o} cube into the {p} tray",
                 "move the {o} block to the {p} tray", "the {o} cube goes in the {p} tray"]  # fmt: skip
    rows = [(k, o, p) for k in range(4) for o in range(3) for p in range(2)]
    text = [templates[k].format(o=("red", "green", "blue")[o], p=("yellow", "purple")[p]) for k, o, p in rows]
    y_obj, y_place = torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])
    train = torch.tensor([r[0] < 3 for r in rows])  # the 4th phrasing is never fitted nor trained on
    losses, held_out = {}, {}
    for standardize in (False, True):
        enc = TextEncoder(5, backend="minilm", standardize=standardize)
        enc.fit([t for t, keep in zip(text, train) if keep])
        torch.manual_seed(0)
        enc.proj.reset_parameters()
        optim = torch.optim.AdamW(enc.proj.parameters(), lr=1e-4)
        for _ in range(100):
            out = enc(text)[:, 0]
            loss = sum(torch.nn.functional.cross_entropy(o[train], y[train])
                       for o, y in ((out[:, :3], y_obj), (out[:, 3:], y_place)))  # fmt: skip
            optim.zero_grad()
            loss.backward()
            optim.step()
        losses[standardize] = float(loss.detach())
        out = enc(text)[:, 0].detach()
        held_out[standardize] = float(
            ((out[~train, :3].argmax(-1) == y_obj[~train]) & (out[~train, 3:].argmax(-1) == y_place[~train]))
            .float().mean()
        )  # fmt: skip
    assert losses[False] > 1.5 and losses[True] < 0.6, losses  # chance: ln 3 + ln 2 = 1.79
    assert held_out[True] == 1.0, held_out


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
    no_state = EncoderConfig(**{**ENC.__dict__, "use_state": False})
    enc = ObservationEncoder(no_state, SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash")
    assert "state" not in enc.modalities and enc.state_normalizer.normalize(torch.zeros(1, 5)).shape == (1, 5)
    o = obs()
    torch.testing.assert_close(enc(o), enc(dict(o, state=o["state"] + 1.0)))  # the state is not read


def test_concat_fusion_is_the_tokens_and_the_text_side_by_side():
    """``fusion=concat`` (DP3's, diffusion_policy's): no readout, no attention; the head reads exactly the
    modality tokens and the instruction's vector, so the condition is linear in them."""
    cfg = EncoderConfig(**{**ENC.__dict__, "fusion": "concat"})
    enc = ObservationEncoder(cfg, SPEC, n_obs_steps=2, cond_dim=20, text_backend="hash")
    assert enc.readout is None and len(enc.layers) == 0 and not hasattr(enc, "cross")
    n_vis = enc.encoders["rgb"].n_tokens + enc.encoders["points"].n_tokens + 1
    assert enc.n_tokens == 2 * n_vis  # no readout token
    assert enc.head.in_features == (enc.n_tokens + 1) * D
    o = obs(to=2)
    cond = enc(o)
    assert cond.shape == (2, 20)
    cond.sum().backward()
    assert all(p.grad is not None for n, p in enc.named_parameters() if n.startswith("head."))
    c2 = enc(dict(o, instruction=["pick the blue cube", "pick the red cube"]))
    assert not torch.allclose(cond, c2, atol=1e-5)  # the instruction still reaches the condition
    with pytest.raises(ValueError, match="policy.encoder.fusion"):
        EncoderConfig(fusion="sum")


def test_text_changes_condition():
    enc = ObservationEncoder(ENC, SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash")
    o = obs()
    c1 = enc(o)
    c2 = enc(dict(o, instruction=["pick the blue cube", "pick the red cube"]))
    assert not torch.allclose(c1, c2, atol=1e-5)


def test_blank_text_reads_every_instruction_as_empty():
    """policy.encoder.blank_text (the text ablation): the instruction no longer changes the condition, which
    is the same encoder's condition for ''."""
    import dataclasses

    enc = ObservationEncoder(ENC, SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash")
    blank = ObservationEncoder(
        dataclasses.replace(ENC, blank_text=True), SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash"
    )
    blank.load_state_dict(enc.state_dict())
    o = obs()
    other = dict(o, instruction=["pick the blue cube", "pick the red cube"])
    torch.testing.assert_close(blank(o), blank(other))
    torch.testing.assert_close(blank(o), enc(dict(o, instruction=["", ""])))


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
    # The point encoder is modulated the same way.
    assert ObservationEncoder(ENC, SPEC, 1, 20, text_backend="hash").encoders["points"].text_film is not None
    assert ObservationEncoder(off, SPEC, 1, 20, text_backend="hash").encoders["points"].text_film is None


def test_encoder_grad_checkpointing_same_gradients():
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        enc = ObservationEncoder(ENC, SPEC, n_obs_steps=1, cond_dim=20, text_backend="hash").train()
        enc.grad_checkpointing = ckpt
        enc(obs()).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in enc.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])
