"""Multi-stage tasks (issue 62): the sub-task selector learns the demonstrations' labels, the hierarchy hands
its choice (and a person's later correction) to the low-level policy, and the commands run end to end."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from diffpolicy.cli import compose
from diffpolicy.config import BCConfig, DeviceConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.data.windows import DemoWindows
from diffpolicy.demos import collect_demos
from diffpolicy.device import Runtime
from diffpolicy.hierarchy import label_accuracy, load_selector, train_selector, write_corrections
from diffpolicy.logger import Logger
from diffpolicy.policies.selector import HierarchicalPolicy, SubtaskSelector

CPU = Runtime.from_config(DeviceConfig(type="cpu"))
STAGES_STATE = EnvConfig(name="mujoco_stages", id="diffpolicy_envs:MujocoDialogue-v0", obs_mode="state",
                         max_episode_steps=180, kwargs={"task": "stages"})  # fmt: skip
SMALL = PolicyConfig(
    kind="selector", cond_dim=32, encoder=EncoderConfig(token_dim=16, fusion_heads=2, state_hidden=32)
)
VOCAB = ["put the red cube in the yellow tray", "put the blue cube in the purple tray"]


def test_selector_shapes_and_vocabulary():
    sel = SubtaskSelector(SMALL.encoder, {"state": [5], "instruction": None}, VOCAB, 32, text_backend="hash")
    obs = {"state": torch.randn(3, 1, 5), "instruction": ["a", "b", "c"]}
    assert sel(obs).shape == (3, 2) and set(sel.select(obs)) <= set(VOCAB)
    with pytest.raises(ValueError, match="distinct"):
        SubtaskSelector(SMALL.encoder, {"state": [5]}, ["one", "one"], 32, text_backend="hash")


class _Low(torch.nn.Module):
    """Records what it is asked to act on."""

    horizon, n_action_steps = 8, 4

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[str]] = []

    def plan(self, obs, **kwargs):
        self.seen.append(list(obs["instruction"]))
        return None, None


def test_hierarchy_hands_the_choice_and_later_utterances_to_the_low_level():
    sel = SubtaskSelector(SMALL.encoder, {"state": [5], "instruction": None}, VOCAB, 32, text_backend="hash")
    with torch.no_grad():  # a selector that always names the second sub-task
        sel.head[-1].weight.zero_()
        sel.head[-1].bias.copy_(torch.tensor([0.0, 5.0]))
    low = _Low()
    policy = HierarchicalPolicy(sel, low)
    task = "put the red cube in the yellow tray, then the blue cube in the purple tray"
    obs = {"state": torch.zeros(2, 1, 5), "instruction": [task, f"{task}\nno, the green one first"]}
    policy.plan(obs, deterministic=True)
    assert low.seen == [[VOCAB[1], f"{VOCAB[1]}\nno, the green one first"]]  # the correction overrides
    assert policy.horizon == 8 and policy.n_action_steps == 4  # the low level's


class _Acting(_Low):
    """Records what it is asked to act on and answers with actions (B, Te, 2) that name the row."""

    def plan(self, obs, **kwargs):
        super().plan(obs)
        b = len(obs["instruction"])
        return torch.arange(b, dtype=torch.float32).view(b, 1, 1).expand(b, 4, 2).clone(), None


def _always_second() -> SubtaskSelector:
    sel = SubtaskSelector(SMALL.encoder, {"state": [5], "instruction": None}, VOCAB, 32, text_backend="hash")
    with torch.no_grad():
        sel.head[-1].weight.zero_()
        sel.head[-1].bias.copy_(torch.tensor([0.0, 5.0]))
    return sel


def test_a_person_corrects_the_selector_and_the_correction_is_kept():
    """Where the selector names another sub-task than the one the task is at, the person's overrides it (the
    low level acts on it) and the decision is kept with the meant sub-task; agreeing and finished
    environments are left alone, and without the person nothing is corrected."""
    task = "put the red cube in the yellow tray, then the blue cube in the purple tray"
    obs = {"state": torch.arange(15.0).view(3, 1, 5), "instruction": [task] * 3}
    info = {"subtask": np.array([VOCAB[0], VOCAB[1], VOCAB[0]], dtype=object)}
    low = _Acting()
    policy = HierarchicalPolicy(_always_second(), low, person=True)
    policy.listen(info, np.array([True, True, False]))  # the third env's episode is over
    policy.plan(obs)
    assert low.seen == [[VOCAB[0], VOCAB[1], VOCAB[1]]]
    assert policy.decisions == 2 and len(policy.corrections) == 1
    kept = policy.corrections[0]
    assert kept["subtask"] == VOCAB[0] and kept["chosen"] == VOCAB[1] and kept["instruction"] == task
    np.testing.assert_array_equal(kept["state"], np.arange(5.0))  # the first env's observation
    np.testing.assert_array_equal(kept["action"], [0.0, 0.0])  # and the first action it took
    with pytest.raises(ValueError, match="subtask"):
        policy.listen({}, np.ones(3, dtype=bool))
    quiet = HierarchicalPolicy(_always_second(), _Acting())
    quiet.listen(info, np.ones(3, dtype=bool))
    quiet.plan(obs)
    assert quiet.low.seen == [[VOCAB[1]] * 3] and quiet.corrections == [] and quiet.decisions == 0


@pytest.fixture(scope="module")
def stage_demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    train = collect_demos(STAGES_STATE, 6, seed=0, out=root / "train")["path"]
    val = collect_demos(STAGES_STATE, 2, seed=100, out=root / "val")["path"]
    return root, train, val


def _object_accuracy(selector: SubtaskSelector, demos: str) -> float:
    """How often the selector's sub-task names the cube of the expert's (the privileged state carries the
    current target's one-hot; which tray is yellow it does not)."""
    data = DemoWindows(demos, 1, 1)
    idx = torch.arange(len(data))
    obs, _ = data.batch(idx)
    cube = [s.split()[2] for s in data.subtask(idx)]  # "put the <colour> cube in the <colour> tray"
    return sum(a.split()[2] == b for a, b in zip(selector.select(obs), cube)) / len(cube)


def test_selector_learns_the_sub_task_labels(stage_demos, tmp_path):
    """Direction: trained on the labels, it names the expert's cube on other seeds' episodes, where the same
    selector untrained guesses."""
    _, train, val = stage_demos
    torch.manual_seed(0)
    bc = BCConfig(epochs=1, steps=1, batch_size=64, lr=1e-9, n_demos=6)
    with Logger(tmp_path / "a", tensorboard=False, progress=False) as log:
        untrained, _ = train_selector(STAGES_STATE, SMALL, bc, train, CPU, log, tmp_path / "a", seed=0,
                                      text_backend="hash")  # fmt: skip
    bc = BCConfig(epochs=40, batch_size=64, lr=3e-3, n_demos=6)
    with Logger(tmp_path / "b", tensorboard=False, progress=False) as log:
        selector, metrics = train_selector(STAGES_STATE, SMALL, bc, train, CPU, log, tmp_path / "b", seed=0,
                                           text_backend="hash")  # fmt: skip
    assert len(metrics["vocabulary"]) >= 4 and metrics["train_accuracy"] > 0.5
    assert _object_accuracy(selector, val) >= 0.8 and _object_accuracy(untrained, val) < 0.6
    assert label_accuracy(selector, val) > label_accuracy(untrained, val)
    again = load_selector(metrics["checkpoint"])
    obs = {"state": torch.randn(4, 1, selector.obs_encoder.state_dim)}
    assert again.select(obs) == selector.select(obs) and again.vocabulary == selector.vocabulary


def test_corrections_teach_the_selector_what_the_person_meant(stage_demos, tmp_path):
    """Direction: corrected decisions (other seeds' observations, each with a sub-task the person insists
    on) join the demonstrations; the selector trained with them names that sub-task on those observations,
    where the one trained on the demonstrations alone does not."""
    _, train, val = stage_demos
    data = DemoWindows(val, 1, 1)
    idx = torch.arange(0, len(data), 4)
    obs, _ = data.batch(idx)
    truth = data.subtask(idx)
    vocabulary = sorted(set(DemoWindows(train, 1, 1).subtask(torch.arange(len(DemoWindows(train, 1, 1))))))
    meant = [next(v for v in vocabulary if v != t) for t in truth]  # never the demonstrations' label
    records = [
        {"state": obs["state"][i, -1].numpy(), "subtask": m, "action": np.zeros(4, dtype=np.float32)}
        for i, m in enumerate(meant)
    ]  # fmt: skip (state observations: no instruction)
    path = write_corrections(records, tmp_path / "corrections", STAGES_STATE)
    assert write_corrections([], tmp_path / "none", STAGES_STATE) is None
    bc = BCConfig(epochs=40, batch_size=64, lr=3e-3, n_demos=6)
    picks = {}
    for name, corrections in (("alone", ()), ("corrected", (str(path),))):
        torch.manual_seed(0)
        with Logger(tmp_path / name, tensorboard=False, progress=False) as log:
            sel, metrics = train_selector(STAGES_STATE, SMALL, bc, train, CPU, log, tmp_path / name, seed=0,
                                          corrections=corrections, text_backend="hash")  # fmt: skip
        assert metrics["n_corrections"] == len(corrections) * len(records)
        picks[name] = sum(a == m for a, m in zip(sel.select(obs), meant)) / len(meant)
    assert picks["corrected"] >= 0.8 and picks["alone"] <= 0.2, picks
    assert meant[0] in metrics["vocabulary"]
    other = write_corrections(
        [{**records[0], "points": np.zeros((4, 3), np.float32)}], tmp_path / "o", STAGES_STATE
    )
    with (
        Logger(tmp_path / "c", tensorboard=False, progress=False) as log,
        pytest.raises(ValueError, match="observe"),
    ):
        train_selector(STAGES_STATE, SMALL, bc, train, CPU, log, tmp_path / "c", seed=0, corrections=[str(other)],
                       text_backend="hash")  # fmt: skip


def test_a_planned_selector_is_the_marginal_over_its_slots():
    """plan_slots: log p(v) = log sum_s p(s | obs, dialogue) p(v | dialogue, s), against a loop; the plan's
    factor reads the dialogue alone, so a plan that holds only some sub-tasks keeps every observation's choice
    among them."""
    spec = {"state": [5], "instruction": None}
    sel = SubtaskSelector(SMALL.encoder, spec, [*VOCAB, "put the green cube in the yellow tray"], 32,
                          text_backend="hash", plan_slots=2).eval()  # fmt: skip
    obs = {"state": torch.randn(3, 1, 5), "instruction": ["a", "b\nc", "a"]}
    with torch.no_grad():
        out = sel(obs)
        stage = sel.head(sel.obs_encoder(obs)).softmax(-1)  # (B, S)
        plan = sel.plan_head(sel.plan(sel.dialogues(obs)) + sel.slots).softmax(-1)  # (B, S, V)
    ref = torch.stack([
        torch.stack([sum(stage[b, s] * plan[b, s, v] for s in range(2)) for v in range(3)]) for b in range(3)
    ]).log()  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(3))
    with (
        torch.no_grad()
    ):  # a plan that holds the first two sub-tasks: the third never wins, whatever the scene
        sel.plan_head[-1].weight.zero_()
        sel.plan_head[-1].bias.copy_(torch.tensor([4.0, 4.0, -8.0]))
        for _ in range(5):
            scene = {"state": torch.randn(3, 1, 5) * 10, "instruction": obs["instruction"]}
            assert set(sel.select(scene)) <= set(VOCAB)
    with pytest.raises(ValueError, match="instruction"):
        SubtaskSelector(SMALL.encoder, {"state": [5]}, VOCAB, 32, text_backend="hash", plan_slots=2)
    with pytest.raises(ValueError, match="policy=selector"):
        PolicyConfig(plan_slots=2)


def test_the_planned_loss_trains_both_factors_where_the_slot_is_known():
    """Known slot: -(log p(slot) + log p(label | slot)); unknown (-1, a correction): -log of the marginal."""
    from diffpolicy.hierarchy import _planned_loss

    spec = {"state": [5], "instruction": None}
    sel = SubtaskSelector(SMALL.encoder, spec, VOCAB, 32, text_backend="hash", plan_slots=2).eval()
    obs = {"state": torch.randn(2, 1, 5), "instruction": ["a", "b"]}
    gen = torch.Generator().manual_seed(0)
    target, at = torch.tensor([1, 0]), torch.tensor([1, -1])
    marginal, loss = _planned_loss(sel, obs, target, at, gen)
    slot, plan = sel.factors(obs)
    want = -(slot[0, 1] + plan[0, 1, 1]) - torch.logsumexp(slot[1] + plan[1, :, 0], 0)
    torch.testing.assert_close(loss, want / 2)
    torch.testing.assert_close(marginal, sel(obs))


def _plans_dataset(path: Path, plans: dict[str, tuple[str, str]], episodes: int, seed: int) -> str:
    """Episodes of two sub-tasks: each step's state is the episode's own random scene (8 numbers, the same at
    every step, which a classifier can learn an episode by) and its progress (0 before the first sub-task is
    done, 1 after); its label the planned sub-task of that progress."""
    from diffpolicy.data.dataset import DemoWriter

    rng = np.random.default_rng(seed)
    writer = DemoWriter(path, env_id="plans", attrs={"obs_every": 1})
    names = sorted(plans)
    for e in range(episodes):
        name = names[e % len(names)]
        progress = np.repeat([0.0, 1.0], 5)[:, None]
        state = np.concatenate([np.repeat(rng.normal(size=(1, 8)) * 3, 10, 0), progress], 1)
        writer.add_episode({"state": state.astype(np.float32), "action": np.zeros((10, 2), np.float32),
                            "instruction": name, "subtask": [plans[name][int(p)] for p in progress[:, 0]]})  # fmt: skip
    return str(writer.close())


def test_a_planned_selector_reads_the_plan_from_the_words(tmp_path):
    """Direction: trained on labelled episodes, the planned selector names each new scene's sub-task of its
    instruction (>= 0.9; 1.0 on 10 of 12 seeds, where the plain classifier reads 0.38-0.67 on 5); the same
    selector untrained does not (< 0.6). Null plan_slots counts the episodes' sub-tasks."""
    subtasks = [
        f"put the {c} cube in the {p} tray" for c in ("red", "green", "blue") for p in ("yellow", "purple")
    ]
    rng = np.random.default_rng(0)
    plans = {f"task {k}": tuple(str(v) for v in rng.choice(subtasks, 2, replace=False)) for k in range(6)}
    train = _plans_dataset(tmp_path / "train", plans, 24, seed=1)
    val = _plans_dataset(tmp_path / "val", plans, 12, seed=2)
    planned = dataclasses.replace(SMALL, plan_slots=None)
    assert DemoWindows(train, 1, 1).subtask_order().tolist()[:10] == [0] * 5 + [1] * 5
    accuracy = {}
    for name, bc in (("untrained", BCConfig(epochs=1, steps=1, batch_size=64, lr=1e-9)),
                     ("trained", BCConfig(epochs=60, batch_size=64, lr=3e-3))):  # fmt: skip
        torch.manual_seed(0)
        with Logger(tmp_path / name, tensorboard=False, progress=False) as log:
            sel, metrics = train_selector(STAGES_STATE, planned, bc, train, CPU, log,
                                          tmp_path / name, seed=0, text_backend="hash")  # fmt: skip
        accuracy[name] = label_accuracy(sel, val)
    assert accuracy["trained"] >= 0.9 and accuracy["untrained"] < 0.6, accuracy
    again = load_selector(metrics["checkpoint"])
    assert again.plan_slots == 2
    obs, _ = DemoWindows(val, 1, 1).batch(torch.arange(10))
    torch.testing.assert_close(again(obs), sel(obs))


def test_a_policy_checkpoint_is_not_a_selector(tmp_path):
    from diffpolicy import checkpoint

    path = checkpoint.save(tmp_path, 1, {"policy": {}}, extra={"kind": "diffusion"})
    with pytest.raises(checkpoint.CheckpointError, match="not a selector"):
        load_selector(path)


TINY = ["env=mujoco_stages", "env.num_envs=2", "env.vectorization=sync", "env.image_size=32", "env.n_points=64",
        "env.max_episode_steps=180", "policy.encoder.rgb_channels=[8]", "policy.encoder.rgb_keypoints=4",
        "policy.encoder.point_channels=[8]", "policy.encoder.point_keypoints=4", "policy.encoder.token_dim=16",
        "policy.encoder.fusion_heads=2", "bc.n_demos=2", "bc.epochs=1", "bc.batch_size=32", "log.progress=false",
        "device=cpu"]  # fmt: skip
LOW = ["policy.down_dims=[16,32]", "policy.cond_dim=16", "policy.step_embed_dim=16", "policy.ddim_steps=2"]


def test_stages_commands_end_to_end(tmp_path, monkeypatch):
    """pretrain the low level on sub-task labels and a selector, then evaluate the hierarchy."""
    from diffpolicy import evaluate, pretrain
    from diffpolicy.config import EvaluateConfig

    monkeypatch.setenv("DIFFPOLICY_TEXT_ENCODER", "hash")
    cache = f"cache_dir={tmp_path / 'cache'}"
    low = pretrain.main(compose("pretrain", [*TINY, *LOW, "bc.instruction=subtask", cache]), tmp_path / "low")
    sel = pretrain.main(
        compose("pretrain", [*TINY, "policy=selector", "val_episodes=1", cache]), tmp_path / "sel"
    )
    assert 0.0 <= sel["val"]["label_accuracy"] <= 1.0 and sel["vocabulary"]
    run = tmp_path / "eval"
    run.mkdir()
    cfg = EvaluateConfig(
        checkpoint=str(Path(low["checkpoint"]).parent), selector=sel["checkpoint"], n_episodes=2
    )
    summary = evaluate.main(cfg, run)
    assert summary["selector"] == sel["checkpoint"] and set(summary["by_kind"]) == {"stages"}
    stages = summary["by_kind"]["stages"]
    assert sum(stages.get("failed_in", {}).values()) == round(2 * (1 - stages["success_rate"]))
    assert os.path.isdir(tmp_path / "low") and "person" not in summary
    # a person corrects the selector; what it said trains the selector again
    run = tmp_path / "corrected"
    run.mkdir()
    summary = evaluate.main(dataclasses.replace(cfg, correct=True, split="val"), run)
    person = summary["person"]
    assert person["decisions"] >= 2 and 0 <= person["corrected"] <= person["decisions"]
    if person["corrected"]:
        again = pretrain.main(compose("pretrain", [*TINY, "policy=selector", cache,
                                                   f"selector_corrections=[{person['corrections']}]"]),
                              tmp_path / "sel2")  # fmt: skip
        assert again["n_corrections"] == person["corrected"]
    with pytest.raises(ValueError, match="selector=PATH"):
        EvaluateConfig(checkpoint="x", correct=True)
    with pytest.raises(ValueError, match="policy=selector"):
        compose("pretrain", [*TINY, "selector_corrections=[x]"])
