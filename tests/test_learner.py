"""The learner registry and protocol (``rl/learner.py``): every learner schema (``LEARNERS`` of
``diffpolicy.config``, named by its ``learner`` constant) has one registered learner class that reads it and
implements everything ``train.py`` calls, and an unknown name fails in one line."""

from __future__ import annotations

import inspect

import pytest

from diffpolicy.config import LEARNERS as SCHEMAS
from diffpolicy.rl.learner import LEARNERS, Learner, learner_class

HEADS = tuple(SCHEMAS)


def test_every_head_has_one_registered_learner() -> None:
    classes = {name: learner_class(name) for name in HEADS}
    assert sorted(LEARNERS) == sorted(HEADS)
    assert len(set(classes.values())) == len(HEADS)
    for name, cls in classes.items():
        assert cls.name == name and cls.config is SCHEMAS[name] and cls.config.learner == name


@pytest.mark.parametrize("name", HEADS)
def test_each_learner_implements_the_protocol(name: str) -> None:
    cls = learner_class(name)
    wanted = [m for m, v in vars(Learner).items() if inspect.isfunction(v) and not m.startswith("_")]
    assert wanted, "the protocol lists no method"
    missing = [m for m in wanted if not callable(getattr(cls, m, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"
    params = list(inspect.signature(cls.update).parameters)
    assert params == ["self", "seed", "step", "iteration"], params


def test_unknown_learner_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="learner 'nope' is not registered; choose one of"):
        learner_class("nope")
