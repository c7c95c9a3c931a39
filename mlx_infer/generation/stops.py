"""Stop strings that may span tokens.

Text is released only when no stop string can still begin inside it, so a caller streaming the
released text never shows the start of a stop string that completes a token later.
"""

from typing import Optional, Sequence, Tuple


class StopStringMatcher:
    """Watches a growing text for stop strings.

    Usage: call `feed(full_text)` with the whole text generated so far after each token; it returns
    (text_safe_to_release, stopped). Once stopped, the released text ends just before the first
    stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.released = 0

    def feed(self, text: str) -> Tuple[str, bool]:
        """Args: text: all text generated so far. Returns: (new text to release, whether a stop string was hit)."""
        cut = self._first_stop(text)
        if cut is not None:
            out = text[self.released:cut]
            self.released = max(self.released, cut)
            return out, True
        end = len(text) - self._held_back(text)
        out = text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return out, False

    def flush(self, text: str) -> str:
        """Release the rest of `text` at the end of generation (no stop string was hit)."""
        out = text[self.released:]
        self.released = len(text)
        return out

    def _first_stop(self, text: str) -> Optional[int]:
        # A stop string may have started in text already released (up to len(stop)-1 chars back).
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.released - longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
