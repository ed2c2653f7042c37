"""Text shown to people (kiln admin's tables and CSV, consoles): which characters in it could
pass for other text."""

from __future__ import annotations

import bisect
import unicodedata

__all__ = ["escaped", "first_hidden"]

# Control characters (a terminal's escape sequences, newlines), line and paragraph separators,
# and the invisible format characters (bidirectional overrides, which reorder the text shown
# around them; zero-width spaces, soft hyphens and tags, which make two names that look alike
# differ).
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): what a renderer that does
# not know a character better shows as nothing, whatever its category (the Hangul fillers are
# letters, the variation selectors and the combining grapheme joiner marks). First and last of
# each range; tests hold it to the `regex` module's property.
_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)
_IGNORABLE_FIRSTS = tuple(first for first, _ in _IGNORABLE)
# a blank that is no space: the braille pattern of no dots
_BLANKS = frozenset({"\u2800"})
# what emoji sequences are made of: the joiner (👩‍💻) and the selectors of text or emoji
# presentation (❤️); shown where they join or select an emoji, hidden anywhere else
_EMOJI_JOINER = "\u200d"
_PRESENTATION = frozenset({"\ufe0e", "\ufe0f"})


def _ignorable(char: str) -> bool:
    point = ord(char)
    index = bisect.bisect_right(_IGNORABLE_FIRSTS, point) - 1
    return index >= 0 and point <= _IGNORABLE[index][1]


def _symbol(char: str) -> bool:
    """A character an emoji can be: a symbol, or (keycaps, ‼, ↔) a digit or punctuation."""
    return unicodedata.category(char)[0] in "SPN"


def _in_emoji(text: str, index: int) -> bool:
    """Whether the joiner or selector at `index` joins two emoji or selects one's presentation."""
    before = text[index - 1] if index > 0 else ""
    if text[index] in _PRESENTATION:
        return bool(before) and _symbol(before)
    after = text[index + 1] if index + 1 < len(text) else ""
    joined = bool(before) and (before in _PRESENTATION or unicodedata.category(before) in ("So", "Sk"))
    return joined and bool(after) and unicodedata.category(after) == "So"


def _hidden_at(text: str, index: int, emoji: bool) -> bool:
    char = text[index]
    if emoji and (char == _EMOJI_JOINER or char in _PRESENTATION) and _in_emoji(text, index):
        return False
    return unicodedata.category(char) in _HIDDEN_CATEGORIES or _ignorable(char) or char in _BLANKS


def first_hidden(text: str, *, emoji: bool = False) -> str | None:
    """The first character of `text` that hides text, or fakes other text, where it is shown,
    if any; with `emoji`, the joiners and selectors of emoji sequences do not."""
    return next((char for index, char in enumerate(text) if _hidden_at(text, index, emoji)), None)


def escaped(text: str) -> str:
    """`text` as a person may read it: each character that would hide or fake text shown as its
    escape (\\u3164), emoji sequences as they are."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(char.encode("unicode_escape").decode("ascii") if _hidden_at(text, index, True) else char
                   for index, char in enumerate(text))
