"""Rule verifiers for the RL overlay: a prompt bank row names its verifier and ground truth, and a
completion's reward is that verifier's verdict, 1.0 or 0.0, with a short reason.

- ``exact_match``: the completion, stripped of surrounding whitespace, equals the ground truth as
  written (a ground truth with surrounding whitespace can never match: ``ground_truth_passes`` says
  so).
- ``int_equal``: the first integer in the completion (ASCII digits, an optional sign right before
  them) equals the ground truth read as an integer. Only the first counts, so a completion that
  echoes the question ("7 + 12 = 19") is wrong; "3.5" reads as 3. Integers are compared as digit
  strings, so a completion of thousands of digits cannot hit Python's int-parsing limit.
- ``regex:<pattern>``: ``re.fullmatch(pattern, completion.strip())``, no flags (write ``(?i)``,
  ``(?s)`` inline). The pattern is everything after the first ':'. The ground truth is not used in
  scoring: it is a reference answer the pattern must accept, which ``ground_truth_passes`` checks.

``verify`` never raises over a completion or a ground truth (a reward that raised would stop
training); it raises ValueError only for a verifier string ``check_verifier`` would refuse.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

_CLIP = 40  # characters of a completion quoted in a verdict's detail
_INTEGER = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True, slots=True)
class Verdict:
    reward: float  # 1.0 right, 0.0 wrong
    detail: str  # short and human-readable: "expected 42, got 41"


def verify(verifier: str, ground_truth: str, completion: str) -> Verdict:
    """The named verifier's verdict on ``completion``."""
    check, argument = _resolve(verifier)
    return check(ground_truth, completion, argument)


def check_verifier(verifier: str) -> None:
    """Raise ValueError if ``verifier`` names no known verifier or carries a bad regex."""
    _resolve(verifier)


def ground_truth_passes(verifier: str, ground_truth: str) -> bool:
    """Whether the ground truth, used as the completion, passes its own verifier: a row that fails
    could never be rewarded. Raises ValueError like ``check_verifier``."""
    return verify(verifier, ground_truth, ground_truth).reward == 1.0


def known_verifiers() -> tuple[str, ...]:
    """How each verifier is written: ("exact_match", "int_equal", "regex:<pattern>")."""
    return tuple(name + "<pattern>" if name.endswith(":") else name for name in _VERIFIERS)


def _exact_match(ground_truth: str, completion: str, _: str) -> Verdict:
    answer = completion.strip()
    return _verdict(
        answer == ground_truth, f"expected {_clip(ground_truth)!r}, got {_clip(answer)!r}"
    )


def _int_equal(ground_truth: str, completion: str, _: str) -> Verdict:
    if not _INTEGER.fullmatch(expected := ground_truth.strip()):
        return _verdict(False, f"ground truth {_clip(ground_truth)!r} is not an integer")
    if not (found := _INTEGER.search(completion)):
        return _verdict(False, "no integer in the completion")
    expected, got = _canonical_integer(expected), _canonical_integer(found.group())
    return _verdict(got == expected, f"expected {_clip(expected)}, got {_clip(got)}")


def _regex_fullmatch(_: str, completion: str, pattern: str) -> Verdict:
    answer = completion.strip()
    matched = _compiled(pattern).fullmatch(answer) is not None
    return _verdict(
        matched,
        f"{_clip(answer)!r} {'matches' if matched else 'does not match'} /{_clip(pattern)}/",
    )


# The one list of verifiers. A name ending in ':' takes the rest of the verifier string as its
# argument.
_VERIFIERS: dict[str, Callable[[str, str, str], Verdict]] = {
    "exact_match": _exact_match,
    "int_equal": _int_equal,
    "regex:": _regex_fullmatch,
}


def _resolve(verifier: str) -> tuple[Callable[[str, str, str], Verdict], str]:
    """The check ``verifier`` names and its argument ('' for those that take none)."""
    name, colon, argument = verifier.partition(":")
    check = _VERIFIERS.get(name + colon)
    if check is None:
        raise ValueError(f"unknown verifier {verifier!r}; known: {', '.join(known_verifiers())}")
    if colon:
        _compiled(argument)  # only regex takes an argument
    return check, argument


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    if not pattern:
        raise ValueError("verifier 'regex:' has an empty pattern")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"verifier 'regex:{pattern}' has a bad pattern: {error}") from None


def _canonical_integer(text: str) -> str:
    """An integer's digits without sign '+' or leading zeros ('-007' -> '-7', '-0' -> '0')."""
    digits = text.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if text.startswith("-") and digits != "0" else digits


def _verdict(right: bool, detail: str) -> Verdict:
    return Verdict(1.0 if right else 0.0, detail)


def _clip(text: str) -> str:
    return text if len(text) <= _CLIP else text[: _CLIP - 3] + "..."
