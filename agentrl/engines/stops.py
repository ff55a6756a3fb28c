"""Stop strings of any length, as SGLang and vLLM honour them.

A request's ``SamplingParams.stop`` ends generation at the first sampled token whose decoding
completes one of the strings; that token is kept in ``output_ids`` (with its logprob), so the
output stays exactly what was sampled and the caller cuts the *text* (``cut_at_stop``).

The check runs after every sampled token and decodes only a tail window of the output: the
last ``4 * len(longest stop) + 2`` tokens. A token decodes to at least one character, or to
part of one when a character is split over byte tokens (at most four bytes in UTF-8), so a
stop string completed by the newest token lies inside that window; an earlier match would
have ended generation earlier.

A request resumed as a new one (partial rollouts on SGLang: prompt + tokens so far) is checked
by its server against the new piece's text only, so a stop string begun before the interruption
and completed after it is missed there: ``open_at_end`` says that one may be under way at the
boundary and ``first_completed`` finds where the joined output completes one, as an
uninterrupted request's check would have.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

__all__ = ["StopStrings", "cut_at_stop"]


class StopStrings:
    """The stop strings of one request over a ``decode(ids) -> str`` function."""

    __slots__ = ("stops", "window", "_decode")

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(s for s in stops if s)
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 2
        self._decode = decode

    def __bool__(self) -> bool:
        return bool(self.stops)

    def completed(self, output_ids: Sequence[int]) -> str | None:
        """The stop string that the decoded tail of ``output_ids`` contains, if any."""
        if not self.stops or not output_ids:
            return None
        text = self._decode(list(output_ids[-self.window :]))
        return next((s for s in self.stops if s in text), None)

    def first_completed(self, output_ids: Sequence[int], positions: Iterable[int]) -> tuple[int, str] | None:
        """The first of ``positions`` (ascending token indices) at which ``output_ids`` up to and
        including that token completes a stop string (``completed``), with the string."""
        for at in positions:
            hit = self.completed(output_ids[: at + 1])
            if hit is not None:
                return at, hit
        return None

    def open_at_end(self, output_ids: Sequence[int]) -> bool:
        """Whether the decoded tail of ``output_ids`` ends inside a possible stop string: with a
        proper prefix of one, or with a character whose bytes are not all there yet (U+FFFD)."""
        if not self.stops or not output_ids:
            return False
        text = self._decode(list(output_ids[-self.window :]))
        return text.endswith("\ufffd") or any(text.endswith(s[:k]) for s in self.stops for k in range(1, len(s)))


def cut_at_stop(text: str, stops: Sequence[str], *, keep: bool = False) -> tuple[str, str | None]:
    """``text`` up to its first stop string (the string itself kept when ``keep``), and that
    string (None: no stop string in ``text``, returned whole)."""
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, None
    at, stop = min(found, key=lambda f: (f[0], -len(f[1])))
    return (text[: at + len(stop)] if keep else text[:at]), stop
