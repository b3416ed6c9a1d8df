"""The failure map: MujocoPick's info["outcome"] per episode, and the evaluation's reason counts."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from diffpolicy.evaluation import EvalResult, Exploration, failure_counts
from diffpolicy_envs.experts import make_expert
from diffpolicy_envs.mujoco_pick import OUTCOMES


def _episode(seed: int, act, **env_kwargs) -> dict:
    env = gym.make("diffpolicy_envs:MujocoPick-v0", obs_mode="state", **env_kwargs)
    env.reset(seed=seed)
    done, info = False, {}
    while not done:
        _, _, term, trunc, info = env.step(act(env))
        done = term or trunc
    env.close()
    assert info["outcome"] in OUTCOMES
    return info


def test_expert_outcomes_name_what_went_wrong() -> None:
    precise = {}

    def expert(**kw):
        state = {}

        def act(env):
            if "e" not in state:
                state["e"] = make_expert(env, seed=0, **kw)
            return state["e"].act(env)

        return act

    assert _episode(0, expert(**precise))["outcome"] == "success"
    assert _episode(0, expert(max_speed=0.002))["outcome"] == "timed_out"  # far too slow to finish
    beside = _episode(0, expert(place_bias=(0.10, 0.0)))
    assert beside["outcome"] == "missed_tray" and beside["lost_grip"] == "released"  # released beside it


def test_wrong_cube_and_missed_grasp() -> None:
    state = {}

    def wrong(env):  # the expert is shown another cube as the target while it decides
        u = env.unwrapped
        if "e" not in state:
            state["e"] = make_expert(env, seed=0)
        true = u.target_id
        u.target_id = (true + 1) % 3
        try:
            return state["e"].act(env)
        finally:
            u.target_id = true

    assert _episode(1, wrong)["outcome"] == "wrong_cube"

    def close_in_place(env):  # stays above the start and closes the jaws: a grasp far from the cube
        a = np.zeros(7, np.float32)
        a[2], a[6] = 0.5, 1.0
        return a

    info = _episode(2, close_in_place)
    assert info["outcome"] == "never_grasped" and info["grasp_miss"] > 0.05

    def never_close(env):
        a = np.zeros(7, np.float32)
        a[6] = -1.0
        return a

    info = _episode(2, never_close)
    assert info["outcome"] == "timed_out" and np.isnan(info["grasp_miss"])


def test_dropped_when_the_grasp_is_lost_away_from_the_tray() -> None:
    state = {"t": 0}

    def drop_early(env):
        if "e" not in state:
            state["e"] = make_expert(env, seed=0)
        a = state["e"].act(env)
        if env.unwrapped.target_grasped() and state.setdefault("held", 0) >= 0:
            state["held"] += 1
        if state.get("held", 0) > 12:  # lifted for a while: open the jaws before reaching the tray
            a = a.copy()
            a[6] = -1.0
        return a

    info = _episode(0, drop_early)
    assert info["outcome"] == "dropped" and info["lost_grip"] == "released"  # the policy let go

    env = gym.make("diffpolicy_envs:MujocoPick-v0", obs_mode="state")
    env.reset(seed=0)
    u, expert, held, info = env.unwrapped, make_expert(env, seed=0), 0, {}
    for _ in range(120):  # the expert grasps and lifts; then the cube loses its friction in closed jaws
        a = expert.act(env)
        held += u.target_grasped()
        if held > 12:
            for g in (int(u.cube_geoms[u.target_id]), *map(int, u.finger_geoms)):  # contacts take the max
                u.model.geom_friction[g] = 0.0
            a = a.copy()
            a[6] = 1.0
        info = env.step(a)[-1]
        if info["lost_grip"]:
            break
    env.close()
    assert info["outcome"] == "dropped" and info["lost_grip"] == "slipped"


def test_drops_say_how_the_grasp_was_lost() -> None:
    res = EvalResult(
        success_rate=0.25, mean_return=0.0, episodes=4, env_steps=0, successes=[True, False, False, False],
        outcomes=["success", "dropped", "dropped", "missed_tray"], lost_grip=["", "slipped", "released", "released"],
    )  # fmt: skip
    assert res.drops() == {"dropped/released": 1, "dropped/slipped": 1, "missed_tray/released": 1}
    assert EvalResult(0.0, 0.0, 1, 0, [False], ["dropped"]).drops() == {"dropped/unknown": 1}


def test_corrected_kinds_split_by_whether_a_cube_was_held() -> None:
    ok = [True, False, False, True, True]
    res = EvalResult(0.6, 0.0, 5, 0, ok, ["success", "wrong_cube", "timed_out", "success", "success"],
                     kinds=["object", "object", "object", "place", "none"],
                     holding=[True, True, False, False, None])  # fmt: skip
    kinds = res.by_kind()
    assert kinds["object"]["holding"] == {"episodes": 2, "success_rate": 0.5}
    assert kinds["object"]["not_holding"] == {"episodes": 1, "success_rate": 0.0}
    assert (
        kinds["place"]["not_holding"] == {"episodes": 1, "success_rate": 1.0}
        and "holding" not in kinds["place"]
    )
    assert "holding" not in kinds["none"] and "not_holding" not in kinds["none"]
    staged = EvalResult(0.25, 0.0, 4, 0, [True, False, False, False], ["success"] + ["timed_out"] * 3,
                        kinds=["stages"] * 4, stages=[1, 0, 1, 1])  # fmt: skip
    assert staged.by_kind()["stages"]["failed_in"] == {"1": 1, "2": 2}


def test_failure_counts_and_exploration_noise() -> None:
    counts = failure_counts([True, False, False, False], ["success", "dropped", "dropped", "timed_out"])
    assert counts == {"dropped": 2, "timed_out": 1}
    assert failure_counts([False, False], []) == {"failed": 2}  # envs that report no outcome
    rng = np.random.default_rng(0)
    acts = np.zeros((3, 8, 7), np.float32)
    held = Exploration(0.1, "chunk").apply(acts, rng)
    assert held.shape == acts.shape and np.allclose(held, held[:, :1])  # one draw held over the chunk
    fresh = Exploration(0.1, "step").apply(acts, rng)
    assert not np.allclose(fresh, fresh[:, :1])
    assert np.abs(Exploration(5.0, "step").apply(acts, rng)).max() <= 1.0
    with pytest.raises(ValueError, match="hold"):
        Exploration(0.1, "episode")


def test_reachability_counts_scenes_reached_per_reason(monkeypatch) -> None:
    """Each failed scene gets ``tries`` episodes; a scene is reached when any succeeds, counted per reason."""
    from diffpolicy import evaluation

    outcome = {5: [False, True], 6: [False, False], 7: [True, True]}
    seen: dict = {}

    def fake_evaluate(policy, cfg, *, seeds, **kwargs):
        seen["seeds"] = list(seeds)
        ok = [outcome[s][seeds[: i + 1].count(s) - 1] for i, s in enumerate(seeds)]
        return EvalResult(float(np.mean(ok)), 0.0, len(ok), 0, ok)

    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    kw = dict(tries=2, n_action_steps=8, num_envs=2, device=None, deterministic=True)
    out = evaluation.reachability(
        None, None, [5, 6, 7], reasons=["dropped", "never_grasped", "dropped"], **kw
    )
    assert seen["seeds"] == [5, 5, 6, 6, 7, 7]
    assert out["reachable"] == round(2 / 3, 4) and out["reachable_seeds"] == [5, 7]
    assert out["success_rate"] == 0.5
    assert out["by_reason"] == {"dropped": [2, 2], "never_grasped": [0, 1]}
    assert "by_reason" not in evaluation.reachability(None, None, [6], **kw)
    with pytest.raises(ValueError, match="reasons"):
        evaluation.reachability(None, None, [5, 6], reasons=["dropped"], **kw)
