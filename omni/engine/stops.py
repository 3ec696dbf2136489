"""Stop strings over streamed text, without ever leaking part of a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feeds text deltas; holds back any tail that could still grow into a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        text = self._pending + delta
        # The stop that completes first ends generation (ties: the one starting first), so
        # the result never depends on how the text arrived in pieces.
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)[1]], True
        hold = max((self._partial_suffix(text, s) for s in self.stops), default=0)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Text held back when generation ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    @staticmethod
    def _partial_suffix(text: str, stop: str) -> int:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0
