"""``MujocoDialogue-v0``: the pick task with two trays and an instruction that a person corrects mid-episode.

The scene is :mod:`~diffpolicy_envs.mujoco_pick`'s with a second tray: a ``yellow`` and a ``purple`` one, on
the two sides of the table (which colour stands left is drawn per episode), the three cubes between them. The
first utterance names an object and a place ("put the red cube in the purple tray"). Then, per episode kind
(drawn from ``kinds``):

| kind | what is said, at a step drawn from ``correction_steps`` |
|---|---|
| ``none`` | nothing more |
| ``object`` | a correction of the object only ("no, not the red one, the blue one"): the place was said only before |
| ``place`` | a correction of the place only ("actually, the yellow tray"): the object was said only before |

The window of ``correction_steps`` (default 6..40) spans the scripted expert's first grasp (steps 18-30), so
about half the object corrections find the wrong cube already in the gripper; the expert then puts it back
where it lay and fetches the new one (:class:`~diffpolicy_envs.experts.PickExpert`). Success is the object
finally meant resting, released, in the place finally meant; the episode terminates on it.

Observation: as ``MujocoPick-v0``'s, with ``instruction`` holding the **dialogue so far**, one utterance per
line (``TURN_SEP``; a dialogue of one utterance is exactly a static instruction). ``dialogue_view="latest"``
gives the last utterance only: what a policy without a memory of the dialogue reads. With
``obs_mode="state"`` the privileged state carries the resolved meaning (target one-hot and position, the
current place's centre), so it follows corrections without language.

``info`` adds ``place_id`` / ``place_color`` (the place meant now), ``dialogue_kind`` (the kind of the
corrections spoken so far: ``none`` until one is), ``correction_step`` (the step the correction is spoken on,
-1 for none), ``corrected_holding`` (whether the gripper held a cube when it was spoken) and ``turns``; its
``outcome`` adds ``wrong_place``: the object meant rests in the other tray. ``target_id`` / ``target_pos``
follow the meaning of the moment: training labels and the failure map only, never observed. With
``label="both"`` (default) ``target_pos`` is (6,): the object's centre, then the place's (BC's auxiliary
label locates both slots); ``label="object"`` gives MujocoPick's (3,).

**Multi-stage tasks** (``task="stages"``): the one utterance names two sub-tasks in order, each a cube into a
tray, the two trays different ("put the red cube in the yellow tray, then the blue cube in the purple
tray"). The meaning of the moment is the current sub-task (``target_id``, ``place_id``, ``tray_pos``); when its
cube rests in its tray the next one begins (the sub-task's success reward is paid, the episode goes on), and the
episode succeeds when the last one's does with the earlier cubes still in their trays (one knocked out makes
its sub-task current again). ``info`` adds ``stage`` (index of the current sub-task), ``stages`` and
``subtask``: the current sub-task as a one-step instruction ("put the blue cube in the purple tray"): the
label of a high-level selector, and what a low-level policy conditioned on sub-tasks reads. The expert
follows the current sub-task, so its demonstrations carry these labels; ``dialogue_kind`` is ``stages``.

Phrasings: each kind of utterance has training phrasings and held-out ones; ``phrasings="train"`` (default)
draws from the first, ``"heldout"`` from the second only (report test episodes with them).
"""

from __future__ import annotations

from typing import Any

import mujoco
import numpy as np
from gymnasium import spaces

from diffpolicy_envs.mujoco_pick import (
    CHARSET,
    COLORS,
    CUBE_HALF,
    OUTCOMES,
    TRAY_FLOOR_Z,
    TRAY_INNER_HALF,
    TRAY_X_RANGE,
    MujocoPickEnv,
    _asset_path,
)

PLACES = ("yellow", "purple")
"""Tray colours; the index is the ``place_id``."""
PLACE_RGBA = {"yellow": (0.88, 0.72, 0.12, 1.0), "purple": (0.48, 0.24, 0.62, 1.0)}
KINDS = ("none", "object", "place")
"""Episode kinds: no correction, the object corrected, the place corrected."""
DIALOGUE_OUTCOMES = (*OUTCOMES, "wrong_place")
"""Values of ``info["outcome"]``: MujocoPick's and ``wrong_place``."""
TURN_SEP = "\n"
"""Separator of the utterances in the ``instruction`` observation."""
CAPTION_LINES = 3
"""Utterances captioned under a video frame (the latest ones)."""
DIALOGUE_CHARSET = CHARSET + "," + TURN_SEP
TRAY_Y_SIDE = (0.27, 0.31)
"""Range (m) of |y| of a tray's centre: one tray on each side of the table."""
CUBE_Y_RANGE = (-0.12, 0.12)
"""Range (m) of the cubes' y: between the trays."""

# {o}: object colour, {p}: place colour, {old}: what was meant before. Held-out phrasings are for test only.
FIRST = {
    "train": (
        "put the {o} cube in the {p} tray",
        "place the {o} cube into the {p} tray",
        "move the {o} block to the {p} tray",
        "pick up the {o} cube and drop it in the {p} tray",
    ),
    "heldout": (
        "the {o} cube goes in the {p} tray",
        "put the {o} block inside the {p} tray",
    ),
}
OBJECT_CORRECTION = {
    "train": (
        "no, not the {old} one, the {o} one",
        "sorry, i meant the {o} cube",
        "actually take the {o} cube",
        "wrong cube, get the {o} one",
        "no, the {o} block",
    ),
    "heldout": (
        "stop, i wanted the {o} cube instead",
        "not that one, pick the {o} block",
    ),
}
PLACE_CORRECTION = {
    "train": (
        "no, put it in the {p} tray",
        "actually, the {p} tray",
        "sorry, i meant the {p} tray",
        "wrong tray, use the {p} one",
        "no, not the {old} tray, the {p} one",
    ),
    "heldout": (
        "change of plan, the {p} tray instead",
        "make that the {p} tray",
    ),
}
STAGES = {
    "train": (
        "put the {o1} cube in the {p1} tray, then the {o2} cube in the {p2} tray",
        "first the {o1} cube into the {p1} tray, then the {o2} cube into the {p2} tray",
        "sort the cubes, {o1} to the {p1} tray first, then {o2} to the {p2} tray",
    ),
    "heldout": ("the {o1} cube goes to the {p1} tray, after that the {o2} cube to the {p2} tray",),
}
SUBTASK = FIRST["train"][0]
"""A sub-task as a one-step instruction (``info["subtask"]``): "put the {o} cube in the {p} tray"."""
TASKS = ("dialogue", "stages")
PHRASINGS = ("train", "heldout")
LABELS = ("both", "object")
DIALOGUE_VIEWS = ("full", "latest")


class MujocoDialogueEnv(MujocoPickEnv):
    """MujocoPick with two trays and a corrected instruction; see the module docstring.

    Args:
        task: "dialogue" (one pick, maybe corrected) or "stages" (two sub-tasks in order).
        kinds: episode kinds to draw from, uniformly (a subset of :data:`KINDS`; task="dialogue" only).
        correction_steps: (first, last) step, inclusive, after which a correction may be spoken.
        phrasings: "train" or "heldout": which phrasings the utterances use.
        dialogue_view: "full" (every utterance so far) or "latest" (the last one only).
        label: what ``info["target_pos"]`` holds: "both" (the object's and the place's centre, (6,)) or
            "object" ((3,)).
        **kwargs: :class:`~diffpolicy_envs.mujoco_pick.MujocoPickEnv`'s (``target_color`` is not taken).
    """

    cube_y_range = CUBE_Y_RANGE

    def __init__(
        self,
        task: str = "dialogue",
        kinds: tuple[str, ...] | list[str] = KINDS,
        correction_steps: tuple[int, int] | list[int] = (6, 40),
        phrasings: str = "train",
        dialogue_view: str = "full",
        label: str = "both",
        **kwargs: Any,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        kinds = tuple(kinds)
        if not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
        steps = tuple(correction_steps)
        if len(steps) != 2 or any(int(s) != s for s in steps) or not 1 <= steps[0] <= steps[1]:
            raise ValueError(
                f"correction_steps must be (first, last) steps with 1 <= first <= last, got {correction_steps!r}"
            )
        lo, hi = int(steps[0]), int(steps[1])
        if phrasings not in PHRASINGS:
            raise ValueError(f"phrasings must be one of {PHRASINGS}, got {phrasings!r}")
        if dialogue_view not in DIALOGUE_VIEWS:
            raise ValueError(f"dialogue_view must be one of {DIALOGUE_VIEWS}, got {dialogue_view!r}")
        if label not in LABELS:
            raise ValueError(f"label must be one of {LABELS}, got {label!r}")
        if kwargs.get("target_color") is not None:
            raise ValueError("MujocoDialogue draws its target from the dialogue; target_color is not taken")
        self.task = task
        self.kinds = kinds
        self.stages: list[tuple[int, int]] = []
        """task="stages": the (cube, place) of each sub-task, in order."""
        self.stage = 0
        self.correction_steps = (lo, hi)
        self.phrasings = phrasings
        self.dialogue_view = dialogue_view
        self.label = label
        self.place_id = 0
        self.turns: list[str] = []
        self.kind = "none"
        self.correction_step = -1
        self.corrected_holding = False
        self._pending: tuple[str, int, str] | None = None  # (kind, new slot value, utterance)
        self._speak_at = 0
        super().__init__(**kwargs)

    # ------------------------------------------------------------------------------------------- scene
    def _load_model(self) -> mujoco.MjModel:
        """pick.xml with the tray recoloured yellow and a purple copy of it (body ``tray_b``)."""
        spec = mujoco.MjSpec.from_file(_asset_path("pick.xml"))
        first = spec.body("tray")
        second = spec.worldbody.add_body(name="tray_b", pos=[0.4, -0.3, 0.0])
        for geom in first.geoms:
            copy = second.add_geom(type=geom.type, size=geom.size, pos=geom.pos)
            copy.name = f"{geom.name}_b" if geom.name else ""
            copy.rgba = PLACE_RGBA[PLACES[1]]
            geom.rgba = PLACE_RGBA[PLACES[0]]
        return spec.compile()

    def _index_model(self) -> None:
        super()._index_model()
        self.tray_bodies = (self.tray_body, self.model.body("tray_b").id)

    def _observation_space(self) -> spaces.Dict:
        space = super()._observation_space()
        if "instruction" in space.spaces:
            space.spaces["instruction"] = spaces.Text(max_length=256, min_length=1, charset=DIALOGUE_CHARSET)
        return space

    @property
    def place_positions(self) -> np.ndarray:
        """Centres (2, 3) m of the yellow and the purple tray."""
        return self.model.body_pos[list(self.tray_bodies)].copy()

    def _draw_task(self, rng: np.random.Generator) -> None:
        """Target, place, tray sides, the first utterance and the correction to come."""
        self.target_id = int(rng.integers(3))
        self.place_id = int(rng.integers(2))
        left = int(rng.integers(2))  # which tray stands at +y
        for pid, body in enumerate(self.tray_bodies):
            side = 1.0 if pid == left else -1.0
            self.model.body_pos[body] = (rng.uniform(*TRAY_X_RANGE), side * rng.uniform(*TRAY_Y_SIDE), 0.0)
        self.set_place(self.model.body_pos[self.tray_bodies[self.place_id]])
        table = self.phrasings
        self._pending, self.stage, self.stages = None, 0, []
        self.kind, self.correction_step, self.corrected_holding = "none", -1, False
        if self.task == "stages":
            second = (self.target_id + 1 + int(rng.integers(2))) % 3
            self.stages = [(self.target_id, self.place_id), (second, 1 - self.place_id)]
            text = STAGES[table][int(rng.integers(len(STAGES[table])))]
            (o1, p1), (o2, p2) = self.stages
            self.turns = [text.format(o1=COLORS[o1], p1=PLACES[p1], o2=COLORS[o2], p2=PLACES[p2])]
            self.instruction, self.kind = self._view(), "stages"
            return
        first = FIRST[table][int(rng.integers(len(FIRST[table])))]
        self.turns = [first.format(o=COLORS[self.target_id], p=PLACES[self.place_id])]
        self.instruction = self._view()
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        if kind == "object":
            new = (self.target_id + 1 + int(rng.integers(2))) % 3
            text = OBJECT_CORRECTION[table][int(rng.integers(len(OBJECT_CORRECTION[table])))]
            utterance = text.format(o=COLORS[new], old=COLORS[self.target_id])
        elif kind == "place":
            new = 1 - self.place_id
            text = PLACE_CORRECTION[table][int(rng.integers(len(PLACE_CORRECTION[table])))]
            utterance = text.format(p=PLACES[new], old=PLACES[self.place_id])
        if kind != "none":
            self._pending = (kind, new, utterance)
            self._speak_at = int(rng.integers(self.correction_steps[0], self.correction_steps[1] + 1))

    def _view(self) -> str:
        return TURN_SEP.join(self.turns) if self.dialogue_view == "full" else self.turns[-1]

    def render(self) -> np.ndarray | None:
        """MujocoPick's video frame with the dialogue so far captioned below the scene (the latest utterance
        last, in yellow), so that a video shows when a correction arrived."""
        frame = super().render()
        if frame is None:
            return None
        from PIL import Image, ImageDraw, ImageFont  # Pillow comes with imageio, a core dependency

        size = max(10, frame.shape[0] // 24)
        font = ImageFont.load_default(size=size)
        lines = [f"> {t}" for t in self.turns[-CAPTION_LINES:]]
        band = (size + 3) * CAPTION_LINES + 6  # the same for every frame: one video, one frame size ...
        band += -(frame.shape[0] + band) % 16  # ... whose height video encoders take (a multiple of 16)
        image = Image.new("RGB", (frame.shape[1], frame.shape[0] + band), (20, 20, 20))
        image.paste(Image.fromarray(frame), (0, 0))
        draw = ImageDraw.Draw(image)
        for i, line in enumerate(lines):
            colour = (250, 220, 60) if i == len(lines) - 1 else (200, 200, 200)
            draw.text((4, frame.shape[0] + 3 + i * (size + 3)), line, fill=colour, font=font)
        return np.asarray(image)

    # ------------------------------------------------------------------------------------------ gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, self._dialogue_info(info)

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """MujocoPick's step; after it, the correction is spoken if this is its step and the task is not done."""
        obs, reward, terminated, truncated, info = super().step(action)
        if self.stages and terminated:  # the current sub-task is done: the next one, or one undone again
            terminated = self._next_stage()
            if not terminated:
                info.update(is_success=False, outcome="timed_out", grasp_miss=float("nan"), lost_grip="")
        if self._pending is not None and self.elapsed_steps >= self._speak_at and not terminated:
            self._speak()
            if "instruction" in obs:
                obs["instruction"] = self.instruction
            info["instruction"] = self.instruction
        return obs, reward, terminated, truncated, self._dialogue_info(info)

    def _speak(self) -> None:
        """Say the pending correction: the meaning changes, and the outcome record restarts for a new object."""
        kind, new, utterance = self._pending
        self._pending = None
        self.kind, self.correction_step = kind, self.elapsed_steps
        self.corrected_holding = self._holding_a_cube()
        self.turns.append(utterance)
        self.instruction = self._view()
        if kind == "object":
            self._mean(new, self.place_id)
        else:
            self._mean(self.target_id, new)

    def _mean(self, cube: int, place: int) -> None:
        """Make (cube, place) the meaning of the moment: success, the outcome and the reward's goals follow it
        (a new cube's outcome record starts afresh)."""
        if cube != self.target_id:
            self.target_id = cube
            self._prev_cube = self.data.xpos[self.cube_bodies[cube]].copy()  # the reward's goal moves here
            self._reset_outcome()
        self.place_id = place
        self.set_place(self.model.body_pos[self.tray_bodies[place]])

    def _next_stage(self) -> bool:
        """After the current sub-task's success: make the first sub-task whose cube is not (or no longer) in its
        tray current and return False, or return True when every cube rests in its tray."""
        for i, (cube, place) in enumerate(self.stages):
            touching = self._contacts_with(int(self.cube_geoms[cube]))
            if not self._rests_in(cube, self.model.body_pos[self.tray_bodies[place]], touching):
                self.stage = i
                self._mean(cube, place)
                return False
        return True

    def _dialogue_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """MujocoPick's info, its target fields those of the meaning of the moment, plus the dialogue's."""
        cube = self.data.xpos[self.cube_bodies[self.target_id]].copy()
        target_pos = np.concatenate([cube, self.tray_pos]) if self.label == "both" else cube
        info.update(target_id=self.target_id, target_color=COLORS[self.target_id], target_pos=target_pos)
        info.update(
            place_id=self.place_id,
            place_color=PLACES[self.place_id],
            dialogue_kind=self.kind,
            correction_step=self.correction_step,
            corrected_holding=self.corrected_holding,
            turns=len(self.turns),
        )
        if self.stages:
            info.update(
                stage=self.stage,
                stages=len(self.stages),
                subtask=SUBTASK.format(o=COLORS[self.target_id], p=PLACES[self.place_id]),
            )
        return info

    # ----------------------------------------------------------------------------------------- outcome
    def _holding_a_cube(self) -> bool:
        left, right = self.finger_geoms
        for geom in self.cube_geoms:
            touching = self._contacts_with(int(geom))
            if left in touching and right in touching:
                return True
        return False

    def _track_outcome(
        self, closing: bool, grasped: bool, success: bool, ee: np.ndarray, cube: np.ndarray
    ) -> str:
        """MujocoPick's outcome, with ``wrong_place`` when the object meant rests, released, in the other tray."""
        outcome = super()._track_outcome(closing, grasped, success, ee, cube)
        if outcome in ("success", "wrong_cube", "never_grasped") or grasped:
            return outcome
        other = self.model.body_pos[self.tray_bodies[1 - self.place_id]]
        rel = cube - other
        inside = abs(rel[0]) < TRAY_INNER_HALF and abs(rel[1]) < TRAY_INNER_HALF
        return "wrong_place" if inside and rel[2] < TRAY_FLOOR_Z + CUBE_HALF + 0.015 else outcome


__all__ = [
    "DIALOGUE_OUTCOMES",
    "KINDS",
    "PLACES",
    "TURN_SEP",
    "MujocoDialogueEnv",
]
