"""MujocoDialogue-v0 (issue 62): two trays, corrections of the object or the place mid-episode, the expert that
follows the latest meaning, held-out phrasings, the latest-utterance view, the ``wrong_place`` outcome."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import numpy as np
import pytest

from diffpolicy_envs.dialogue import (
    FIRST,
    OBJECT_CORRECTION,
    PLACE_CORRECTION,
    PLACES,
    TURN_SEP,
    MujocoDialogueEnv,
)
from diffpolicy_envs.experts import make_expert
from diffpolicy_envs.mujoco_pick import COLORS, CUBE_HALF, TRAY_FLOOR_Z


def _make(**kwargs) -> gym.Env:
    return gym.make("diffpolicy_envs:MujocoDialogue-v0", obs_mode="state", **kwargs)


def _run_expert(env: gym.Env, seed: int) -> tuple[dict, int, list[dict]]:
    """One expert episode; -> (last info, length, every step's info)."""
    expert = make_expert(env)
    _, info = env.reset(seed=seed)
    infos = [info]
    while True:
        _, _, terminated, truncated, info = env.step(expert.act(env))
        infos.append(info)
        if terminated or truncated:
            return info, len(infos) - 1, infos


def _template_of(utterance: str, table: tuple[str, ...], **fill: str) -> str | None:
    for template in table:
        if template.format(**fill) == utterance:
            return template
    return None


def test_one_utterance_is_a_static_instruction():
    env = _make(kinds=["none"])
    for seed in range(5):
        _, info = env.reset(seed=seed)
        u = env.unwrapped
        assert TURN_SEP not in u.instruction and len(u.turns) == 1
        assert COLORS[info["target_id"]] in u.instruction and PLACES[info["place_id"]] in u.instruction
        assert info["dialogue_kind"] == "none" and info["correction_step"] == -1
        np.testing.assert_allclose(u.tray_pos, u.place_positions[info["place_id"]])


def test_trays_stand_on_both_sides_and_their_colours_swap():
    env = _make()
    lefts = set()
    for seed in range(20):
        env.reset(seed=seed)
        ys = env.unwrapped.place_positions[:, 1]
        assert ys[0] * ys[1] < 0 and np.all(np.abs(ys) >= 0.27)
        lefts.add(int(ys[0] > 0))
    assert lefts == {0, 1}


def test_object_correction_changes_the_object_only():
    env = _make(kinds=["object"], correction_steps=(3, 3))
    _, info = env.reset(seed=0)
    first_target, place = info["target_id"], info["place_id"]
    for _ in range(3):
        _, _, _, _, info = env.step(np.zeros(7, np.float32))
    u = env.unwrapped
    assert info["dialogue_kind"] == "object" and info["correction_step"] == 3 and info["turns"] == 2
    assert info["target_id"] != first_target and info["place_id"] == place
    first, said = u.instruction.split(TURN_SEP)
    assert COLORS[first_target] in first and PLACES[place] in first
    # the place was said before only
    assert COLORS[info["target_id"]] in said and not any(p in said for p in PLACES)
    np.testing.assert_allclose(info["target_pos"], np.r_[u.cube_pos(info["target_id"]), u.tray_pos])
    assert _make(label="object").reset(seed=0)[1]["target_pos"].shape == (3,)


def test_place_correction_changes_the_place_only():
    env = _make(kinds=["place"], correction_steps=(2, 2))
    _, info = env.reset(seed=1)
    target, first_place = info["target_id"], info["place_id"]
    for _ in range(2):
        _, _, _, _, info = env.step(np.zeros(7, np.float32))
    u = env.unwrapped
    assert info["dialogue_kind"] == "place" and info["target_id"] == target
    assert info["place_id"] == 1 - first_place
    np.testing.assert_allclose(u.tray_pos, u.place_positions[info["place_id"]])
    np.testing.assert_allclose(info["target_pos"][3:], u.tray_pos)  # the label follows the place
    said = u.instruction.split(TURN_SEP)[-1]
    assert PLACES[info["place_id"]] in said and not any(c in said for c in COLORS)


def test_latest_view_reads_the_last_utterance_only():
    full, latest = (
        _make(kinds=["object"], correction_steps=(1, 1)),
        _make(kinds=["object"], correction_steps=(1, 1), dialogue_view="latest"),
    )
    full.reset(seed=3)
    latest.reset(seed=3)
    assert full.unwrapped.instruction == latest.unwrapped.instruction  # one utterance: the same
    full.step(np.zeros(7, np.float32))
    latest.step(np.zeros(7, np.float32))
    assert latest.unwrapped.instruction == full.unwrapped.instruction.split(TURN_SEP)[-1]


def test_multimodal_observation_carries_the_dialogue():
    env = gym.make(
        "diffpolicy_envs:MujocoDialogue-v0", kinds=["place"], correction_steps=(1, 1), image_size=32
    )
    obs, _ = env.reset(seed=0)
    assert obs["instruction"] in env.observation_space["instruction"]
    obs, *_ = env.step(np.zeros(7, np.float32))
    assert (
        obs["instruction"].count(TURN_SEP) == 1 and obs["instruction"] in env.observation_space["instruction"]
    )


@pytest.mark.parametrize("table", [FIRST, OBJECT_CORRECTION, PLACE_CORRECTION])
def test_heldout_phrasings_are_disjoint_and_used_alone(table):
    assert table["train"] and table["heldout"] and not set(table["train"]) & set(table["heldout"])


def test_heldout_env_speaks_only_heldout_phrasings():
    env = _make(phrasings="heldout", correction_steps=(1, 1))
    kinds = set()
    for seed in range(30):
        _, info = env.reset(seed=seed)
        u = env.unwrapped
        old_o, old_p = COLORS[u.target_id], PLACES[u.place_id]
        assert _template_of(u.turns[0], FIRST["heldout"], o=old_o, p=old_p)
        _, _, _, _, info = env.step(np.zeros(7, np.float32))
        kinds.add(info["dialogue_kind"])
        if info["dialogue_kind"] == "object":
            assert _template_of(u.turns[1], OBJECT_CORRECTION["heldout"], o=COLORS[u.target_id], old=old_o)
        elif info["dialogue_kind"] == "place":
            assert _template_of(u.turns[1], PLACE_CORRECTION["heldout"], p=PLACES[u.place_id], old=old_p)
    assert kinds == {"none", "object", "place"}


def test_seeded_dialogue_is_reproducible():
    a, b = _make(correction_steps=(1, 1)), _make(correction_steps=(1, 1))
    for seed in (0, 7):
        a.reset(seed=seed)
        b.reset(seed=seed)
        a.step(np.zeros(7, np.float32))
        b.step(np.zeros(7, np.float32))
        assert a.unwrapped.turns == b.unwrapped.turns
        np.testing.assert_array_equal(a.unwrapped.place_positions, b.unwrapped.place_positions)


def test_reward_goal_moves_with_the_correction_without_a_jump():
    env = _make(kinds=["object"], correction_steps=(1, 1))
    env.reset(seed=2)
    env.step(np.zeros(7, np.float32))  # the correction is spoken after this step
    _, _, _, _, info = env.step(np.zeros(7, np.float32))
    assert abs(info["reward_terms"]["distance_improvement"]) < 0.02  # measured toward the new cube both times


def _drop_in(env: gym.Env, place_id: int) -> dict:
    """Teleport the target cube into tray ``place_id`` and let it settle with the jaws open."""
    u = env.unwrapped
    adr = u.cube_qpos_adr[u.target_id]
    centre = u.place_positions[place_id]
    u.data.qpos[adr : adr + 3] = (centre[0], centre[1], TRAY_FLOOR_Z + CUBE_HALF + 0.002)
    u.data.qvel[u.cube_dof_adr[u.target_id] : u.cube_dof_adr[u.target_id] + 6] = 0.0
    for _ in range(10):
        _, _, terminated, _, info = env.step(np.array([0, 0, 1, 0, 0, 0, -1], np.float32))
        if terminated:
            break
    return info


def test_the_other_tray_is_wrong_place_and_the_meant_one_success():
    env = _make(kinds=["none"])
    _, info = env.reset(seed=4)
    info = _drop_in(env, 1 - info["place_id"])
    assert info["outcome"] == "wrong_place" and not info["is_success"]
    _, info = env.reset(seed=4)
    info = _drop_in(env, info["place_id"])
    assert info["outcome"] == "success" and info["is_success"]


@pytest.mark.parametrize("kind", ["none", "object", "place"])
def test_expert_follows_the_latest_meaning(kind):
    env = _make(kinds=[kind])
    holding = 0
    for seed in range(10):
        info, length, infos = _run_expert(env, seed)
        assert info["is_success"], (seed, info["outcome"])
        assert info["dialogue_kind"] == kind and length <= 150
        holding += info["corrected_holding"]
        if kind != "none":  # success is judged on the meaning after the correction
            assert (infos[0]["target_id"], infos[0]["place_id"]) != (info["target_id"], info["place_id"])
    if kind != "none":
        assert 0 < holding < 10  # the window spans the first grasp: corrections before and after it


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kinds": []}, "kinds"),
        ({"kinds": ["colour"]}, "kinds"),
        ({"correction_steps": (5, 2)}, "correction_steps"),
        ({"correction_steps": (0, 3)}, "correction_steps"),
        ({"correction_steps": (1, 2, 3)}, "correction_steps"),
        ({"phrasings": "test"}, "phrasings"),
        ({"dialogue_view": "last"}, "dialogue_view"),
        ({"target_color": "red"}, "target_color"),
        ({"label": "goal"}, "label"),
        ({"task": "sorting"}, "task"),
    ],
)
def test_bad_arguments_fail_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MujocoDialogueEnv(obs_mode="state", **kwargs)


def test_video_frames_caption_the_dialogue_at_one_size():
    env = gym.make(
        "diffpolicy_envs:MujocoDialogue-v0", obs_mode="state", render_mode="rgb_array", render_size=96,
        kinds=["place"], correction_steps=(1, 1),
    )  # fmt: skip
    env.reset(seed=0)
    before = env.render()
    env.step(np.zeros(7, np.float32))
    after = env.render()
    assert before.shape == after.shape and before.shape[0] > 96 and before.dtype == np.uint8
    assert before.shape[0] % 16 == 0  # what video encoders take
    assert not np.array_equal(before[96:], after[96:])  # the correction is captioned


def _put(env: gym.Env, cube: int, place_id: int | None) -> dict:
    """Teleport ``cube`` into tray ``place_id`` (None: onto the table between the trays) and let it settle."""
    u = env.unwrapped
    adr, dof = u.cube_qpos_adr[cube], u.cube_dof_adr[cube]
    if place_id is None:
        x, y, z = 0.62, 0.0, CUBE_HALF + 0.002
    else:
        x, y, _ = u.place_positions[place_id]
        z = TRAY_FLOOR_Z + CUBE_HALF + 0.002
    u.data.qpos[adr : adr + 3] = (x, y, z)
    u.data.qvel[dof : dof + 6] = 0.0
    for _ in range(10):
        _, _, terminated, _, info = env.step(np.array([0, 0, 1, 0, 0, 0, -1], np.float32))
        if terminated:
            break
    return {**info, "terminated": terminated}


def test_stages_advance_sub_task_by_sub_task():
    env = _make(task="stages")
    _, info = env.reset(seed=5)
    u = env.unwrapped
    (o1, p1), (o2, p2) = u.stages
    assert o1 != o2 and p1 != p2 and info["dialogue_kind"] == "stages" and info["stages"] == 2
    assert COLORS[o1] in u.instruction and COLORS[o2] in u.instruction and TURN_SEP not in u.instruction
    assert info["stage"] == 0 and info["subtask"] == f"put the {COLORS[o1]} cube in the {PLACES[p1]} tray"
    info = _put(env, o1, p1)
    assert info["stage"] == 1 and not info["terminated"] and not info["is_success"]
    assert (
        info["target_id"] == o2 and info["subtask"] == f"put the {COLORS[o2]} cube in the {PLACES[p2]} tray"
    )
    _put(env, o1, None)  # knocked out of its tray while the second sub-task runs
    info = _put(env, o2, p2)
    assert info["stage"] == 0 and not info["terminated"] and info["target_id"] == o1  # undone: current again
    info = _put(env, o1, p1)
    assert info["terminated"] and info["is_success"] and info["outcome"] == "success"


def test_expert_does_the_stages_in_order():
    env = _make(task="stages")
    for seed in range(6):
        info, length, infos = _run_expert(env, seed)
        assert info["is_success"] and length <= 170, (seed, info["outcome"], length)
        stages = [i["stage"] for i in infos]
        assert stages == sorted(stages) and set(stages) == {0, 1}  # the first sub-task, then the second


def test_heldout_stages_phrasing():
    from diffpolicy_envs.dialogue import STAGES

    env = _make(task="stages", phrasings="heldout")
    env.reset(seed=0)
    u = env.unwrapped
    (o1, p1), (o2, p2) = u.stages
    fill = dict(o1=COLORS[o1], p1=PLACES[p1], o2=COLORS[o2], p2=PLACES[p2])
    assert u.instruction in [t.format(**fill) for t in STAGES["heldout"]]
    assert not set(STAGES["train"]) & set(STAGES["heldout"])
