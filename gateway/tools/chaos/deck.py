"""Fault decisions drawn from shuffled decks rather than independently: every
block of draws carries its share of faults, and every run of as many faults as
there are kinds injects each kind once, so a short run still injects every kind."""

from __future__ import annotations

import random
from collections.abc import Sequence

BLOCK = 20  # draws per shuffled deck of fault decisions


class FaultDeck:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._deck: list[bool] = []
        self._kinds: list[str] = []

    def draw(self, share: float, kinds: Sequence[str]) -> str | None:
        """The next fault, one of `kinds`, or None; `share` of the draws are faults."""
        if not self._deck:
            faults = round(share * BLOCK)
            self._deck = [True] * faults + [False] * (BLOCK - faults)
            self.rng.shuffle(self._deck)
        if not self._deck.pop():
            return None
        if not self._kinds:
            self._kinds = list(kinds)
            self.rng.shuffle(self._kinds)
        return self._kinds.pop()
