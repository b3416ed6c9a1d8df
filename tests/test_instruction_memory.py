"""The instruction memory (issue 62): a dialogue pooled into k tokens, turns masked per dialogue, recency,
each utterance embedded once, the ObservationEncoder reading it in FiLM and fusion, and that it can learn both
slots of a corrected dialogue where the latest utterance alone cannot."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from diffpolicy.config import EncoderConfig
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.encoders.memory import TURN_SEP, InstructionMemory
from diffpolicy_envs import dialogue as dialogue_env
from diffpolicy_envs.mujoco_pick import COLORS

D = 32


def _memory(k: int = 2, max_turns: int = 8, trained: bool = True) -> InstructionMemory:
    """A memory; ``trained``: its context layers (zero when built) given random weights, as training leaves
    them, so that the earlier turns count."""
    torch.manual_seed(0)
    mem = InstructionMemory(D, k, max_turns=max_turns, heads=2, backend="hash")
    if trained:
        with torch.no_grad():
            for layer in (mem.attn.out, mem.mlp[-1]):
                layer.weight.normal_(0.0, 0.3)
                layer.bias.normal_(0.0, 0.3)
    return mem


def test_a_fresh_memory_reads_the_latest_utterance_as_a_sentence():
    """Built, every memory token is the latest utterance's sentence token: one utterance is the static
    instruction, and training starts from it."""
    mem = _memory(k=3, trained=False)
    sentence = mem.text(["no, the blue one", "put the red cube in the yellow tray"])[:, 0]  # (2, D)
    out = mem(
        ["put the red cube in the yellow tray\nno, the blue one", "put the red cube in the yellow tray"]
    )
    torch.testing.assert_close(out, sentence[:, None].expand(-1, 3, -1))


def test_the_turn_separator_is_the_environments():
    assert TURN_SEP == dialogue_env.TURN_SEP


def test_shapes_and_one_utterance():
    mem = _memory(k=3)
    out = mem(["put the red cube in the yellow tray", "a\nb", "x\ny\nz"])
    assert out.shape == (3, 3, D) and torch.isfinite(out).all()


def test_a_dialogue_does_not_see_its_batch_neighbours():
    mem = _memory()
    alone = mem(["put the red cube in the yellow tray"])
    beside = mem(["put the red cube in the yellow tray", "one\ntwo\nthree\nfour"])
    torch.testing.assert_close(alone[0], beside[0])


def test_order_of_the_turns_matters_and_old_turns_drop_out():
    mem = _memory(max_turns=2)
    a, b, c = mem(["put the red cube in the yellow tray\nno, the blue one",
                   "no, the blue one\nput the red cube in the yellow tray",
                   "hello\nput the red cube in the yellow tray\nno, the blue one"])  # fmt: skip
    assert not torch.allclose(a, b)  # recency: the same turns in the other order read differently
    torch.testing.assert_close(a, c)  # beyond max_turns = 2 the oldest is not read


def test_each_utterance_is_embedded_once():
    mem = _memory()
    mem(["a\nb", "a\nc", "a\nb"])
    mem(["a\nb\nc"])
    assert mem.text.cache_misses == 3  # a, b, c


def test_gradients_reach_projection_recency_queries_and_pool():
    mem = _memory()
    mem(["a\nb", "c"]).square().sum().backward()
    for name, p in mem.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    fresh = _memory(trained=False)  # built: the zero output layers still get gradients, so training starts
    fresh(["a\nb", "c"]).square().sum().backward()
    assert fresh.attn.out.weight.grad.abs().sum() > 0 and fresh.mlp[-1].weight.grad.abs().sum() > 0


ENC = EncoderConfig(rgb_channels=[8, 16], rgb_keypoints=8, point_channels=[8, 16], point_keypoints=4, token_dim=D,
                    fusion_heads=2, state_hidden=32, text_memory=2)  # fmt: skip
SPEC = {"rgb": (24, 24, 3), "points": (50, 3), "state": (5,), "instruction": None}


def _obs(instructions: list[str]) -> dict:
    g = torch.Generator().manual_seed(0)
    b = len(instructions)
    return {
        "rgb": torch.randint(0, 256, (1, 1, 24, 24, 3), dtype=torch.uint8, generator=g).expand(
            b, 1, 24, 24, 3
        ),
        "points": (torch.rand(1, 1, 50, 3, generator=g) * 0.6).expand(b, 1, 50, 3),
        "state": torch.randn(1, 1, 5, generator=g).expand(b, 1, 5),
        "instruction": instructions,
    }


@pytest.mark.parametrize("fusion", ["attention", "concat"])
def test_observation_encoder_reads_the_dialogue(fusion):
    torch.manual_seed(0)
    enc = ObservationEncoder(
        dataclasses.replace(ENC, fusion=fusion), SPEC, 1, cond_dim=24, text_backend="hash"
    )
    assert isinstance(enc.text, InstructionMemory)
    dialogues = ["put the red cube in the yellow tray\nno, the blue one",
                 "put the red cube in the purple tray\nno, the blue one"]  # fmt: skip
    cond = enc(_obs(dialogues))
    assert cond.shape == (2, 24)
    torch.testing.assert_close(cond[0], cond[1])  # built: the latest turn alone (the same one) counts
    with torch.no_grad():  # the context layers as training leaves them
        for layer in (enc.text.attn.out, enc.text.mlp[-1]):
            layer.weight.normal_(0.0, 0.3)
    cond = enc(_obs(dialogues))
    assert not torch.allclose(cond[0], cond[1])  # the same latest turn, another slot said before


def test_memory_off_reads_one_sentence():
    enc = ObservationEncoder(
        dataclasses.replace(ENC, text_memory=0), SPEC, 1, cond_dim=24, text_backend="hash"
    )
    assert not isinstance(enc.text, InstructionMemory) and enc.text_memory == 0


@pytest.mark.parametrize("memory", [2, 0])
def test_standardisation_is_fitted_to_each_utterance(memory):
    """With text_standardize the encoder's fit reads the training instructions' utterances (a memory's each
    turn; one sentence per instruction without it), each distinct one once."""
    cfg = dataclasses.replace(ENC, text_memory=memory, text_standardize=True)
    enc = ObservationEncoder(cfg, SPEC, 1, cond_dim=24, text_backend="hash")
    dialogues = ["put the red cube in the yellow tray", "put the red cube in the yellow tray\nno, the blue one",
                 "put the green cube in the purple tray"]  # fmt: skip
    enc.fit_text(dialogues)
    text = enc.text.text if memory else enc.text
    units = list(dict.fromkeys(u for d in dialogues for u in d.split(TURN_SEP))) if memory else dialogues
    torch.testing.assert_close(text.embed_mean, text.embed(units).mean(0))
    off = ObservationEncoder(
        dataclasses.replace(cfg, text_standardize=False), SPEC, 1, 24, text_backend="hash"
    )
    off.fit_text(dialogues)
    assert not any("embed_" in k for k in off.state_dict())


def test_bad_memory_sizes_fail():
    with pytest.raises(ValueError, match="text_memory"):
        EncoderConfig(text_memory=-1)
    with pytest.raises(ValueError, match="text_memory_turns"):
        EncoderConfig(text_memory_turns=0)


def _corrected_dialogues() -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Every first utterance x object correction of the training phrasings: (dialogues, final object id,
    final place id)."""
    dialogues, objects, places = [], [], []
    for first, corr, (o, p), shift in itertools.product(
        dialogue_env.FIRST["train"][:2], dialogue_env.OBJECT_CORRECTION["train"], itertools.product(range(3), range(2)), (1, 2)
    ):  # fmt: skip
        new = (o + shift) % 3
        said = corr.format(o=COLORS[new], old=COLORS[o])
        dialogues.append(first.format(o=COLORS[o], p=dialogue_env.PLACES[p]) + TURN_SEP + said)
        objects.append(new)
        places.append(p)
    return dialogues, torch.tensor(objects), torch.tensor(places)


def test_memory_learns_both_slots_of_a_corrected_dialogue():
    """The object is in the latest turn, the place only in the first: a readout of the memory learns both."""
    dialogues, objects, places = _corrected_dialogues()
    mem = _memory(k=2, trained=False)  # from the built memory: training must learn to read the first turn
    head = torch.nn.Linear(2 * D, 5)
    opt = torch.optim.Adam([*mem.parameters(), *head.parameters()], lr=3e-3)
    for _ in range(150):
        logits = head(mem(dialogues).flatten(1))
        loss = torch.nn.functional.cross_entropy(logits[:, :3], objects)
        loss = loss + torch.nn.functional.cross_entropy(logits[:, 3:], places)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = head(mem(dialogues).flatten(1))
    assert (logits[:, :3].argmax(1) == objects).float().mean() >= 0.95
    assert (logits[:, 3:].argmax(1) == places).float().mean() >= 0.95
    # the latest turn alone names no place: the same utterance follows both places
    latest = [d.split(TURN_SEP)[-1] for d in dialogues]
    assert any(
        latest[i] == latest[j] and places[i] != places[j] for i in range(len(latest)) for j in range(i)
    )
