"""Long-observation compression for judge prompts: keep the head and the tail, say what was cut."""

from __future__ import annotations

MIN_MAX_CHARS = 80
"""Smallest accepted ``max_chars``: room for the marker of any text under 10^15 characters and a little text."""


def _marker(chars: int, lines: int) -> str:
    return f"\n[... {chars} chars, {lines} lines omitted ...]\n"


def compress_observation(text: str, *, max_chars: int, head_frac: float = 0.5) -> str:
    """Shorten ``text`` to at most ``max_chars`` characters by cutting its middle.

    Text that fits is returned unchanged. Otherwise the result is ``head + marker + tail`` where the marker reads
    ``[... C chars, L lines omitted ...]`` (``C`` characters removed, ``L`` the newlines among them) and the
    characters left after the marker are split ``head_frac`` to the head and the rest to the tail. Error messages
    and final results usually sit at an observation's ends, which is why the middle goes.

    Args:
        text: the observation (tool output, page text).
        max_chars: the length bound, ``>= MIN_MAX_CHARS`` (80).
        head_frac: share of the kept characters taken from the head, in ``[0, 1]``; default 0.5.

    Returns:
        The text itself, or its compressed form of length ``<= max_chars``.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < MIN_MAX_CHARS:
        raise ValueError(f"max_chars must be an int >= {MIN_MAX_CHARS}, got {max_chars!r}")
    if isinstance(head_frac, bool) or not isinstance(head_frac, (int, float)) or not 0.0 <= head_frac <= 1.0:
        raise ValueError(f"head_frac must be a number in [0, 1], got {head_frac!r}")
    if len(text) <= max_chars:
        return text
    # Size the budget with the longest marker this text could need; the real one is never longer.
    budget = max_chars - len(_marker(len(text), len(text)))
    head_n = int(budget * head_frac)
    tail_n = budget - head_n
    cut = text[head_n : len(text) - tail_n]
    return text[:head_n] + _marker(len(cut), cut.count("\n")) + text[len(text) - tail_n :]
