"""The dialogue of each session of a server whose policy reads an instruction memory.

A robot's episode is a session (``Observation.session``). Its requests carry ``texts["instruction"]`` only
when something new is said (one utterance, or several, one per line); the server keeps the utterances heard
so far and gives the policy the whole dialogue, so a correction mid-episode ("no, the blue one") is read
beside the instruction it corrects. A new episode is a new session id.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from diffpolicy.encoders.memory import TURN_SEP
from diffpolicy.serving.wire import MAX_TEXT_CHARS, InvalidObservation


class Dialogues:
    """Session id -> the utterances heard in it, oldest first; thread-safe, least recently heard forgotten.

    Args:
        max_sessions: sessions kept at most (the least recently used is forgotten first).
        max_turns: utterances kept per session (the oldest dropped first; a memory reads the latest few).
    """

    def __init__(self, max_sessions: int = 4096, max_turns: int = 64) -> None:
        if max_sessions < 1 or max_turns < 1:
            raise ValueError(f"max_sessions={max_sessions} and max_turns={max_turns} must be >= 1")
        self.max_sessions, self.max_turns = max_sessions, max_turns
        self._turns: OrderedDict[str, list[str]] = OrderedDict()
        self._lock = threading.Lock()

    def hear(self, session: str, said: str | None) -> str:
        """Add what a request says (None or '': nothing new) to ``session``'s dialogue; -> the dialogue so far,
        utterances joined by ``TURN_SEP``. InvalidObservation for a missing or too long session id, and for a
        session's first request that says nothing."""
        if not 0 < len(session) <= MAX_TEXT_CHARS:
            raise InvalidObservation(
                "this policy reads a dialogue: set Observation.session "
                f"(1..{MAX_TEXT_CHARS} characters) to an id of the robot's episode"
            )
        new = [u.strip() for u in (said or "").split(TURN_SEP) if u.strip()]
        with self._lock:
            turns = self._turns.get(session)
            if turns is None:
                if not new:
                    raise InvalidObservation(
                        f"session {session!r} is new: its first request needs texts['instruction'], what is said"
                    )
                turns = self._turns[session] = []
            turns.extend(new)
            del turns[: -self.max_turns]
            self._turns.move_to_end(session)
            while len(self._turns) > self.max_sessions:
                self._turns.popitem(last=False)
            return TURN_SEP.join(turns)

    def __len__(self) -> int:
        return len(self._turns)

    def turns(self, session: str) -> list[str]:
        """The utterances of ``session`` so far (a copy; [] for an unknown session)."""
        with self._lock:
            return list(self._turns.get(session, []))
