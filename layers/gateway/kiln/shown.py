"""Text shown to people (kiln admin's tables and CSV, consoles): which characters in it could
pass for other text."""

from __future__ import annotations

import unicodedata

__all__ = ["EMOJI_JOINER", "first_hidden", "hidden"]

# Control characters (a terminal's escape sequences, newlines), line and paragraph separators,
# and the invisible format characters (bidirectional overrides, which reorder the text shown
# around them; zero-width spaces, soft hyphens and tags, which make two names that look alike
# differ).
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
# a format character, and what emoji sequences are made of
EMOJI_JOINER = "\u200d"


def hidden(char: str, *, emoji: bool = False) -> bool:
    """Whether `char` hides text, or fakes other text, where it is shown; with `emoji`, the
    joiner of emoji sequences does not."""
    return unicodedata.category(char) in _HIDDEN_CATEGORIES and not (emoji and char == EMOJI_JOINER)


def first_hidden(text: str, *, emoji: bool = False) -> str | None:
    """The first character of `text` that is `hidden`, if any."""
    return next((char for char in text if hidden(char, emoji=emoji)), None)
