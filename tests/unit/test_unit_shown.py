"""kiln.shown: which characters of a name shown to people could pass for other text."""

from __future__ import annotations

import unicodedata

import regex

from kiln.shown import escaped, first_hidden


def test_the_default_ignorable_table_is_unicodes():
    """Every code point the `regex` module holds Default_Ignorable (Unicode's renderers show as
    nothing) is hidden, and none it does not is but controls, separators, format characters (of
    this Python's Unicode, which may be older than regex's) and the blank braille pattern."""
    ignorable = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    for point in range(0x110000):
        char = chr(point)
        if 0xD800 <= point <= 0xDFFF:
            continue  # no text holds a lone surrogate
        expected = bool(ignorable.match(char)) or unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") or char == "\u2800"
        assert (first_hidden(char) is not None) == expected, f"U+{point:04X}"


def test_emoji_joiners_and_selectors_are_hidden_outside_emoji():
    for text in ("👩‍💻", "❤️", "❤️‍🔥", "👩🏽‍💻", "1️⃣", "‼️", "🏳️‍🌈"):
        assert first_hidden(text, emoji=True) is None, text
        assert escaped(text) == text
    for text, hidden in (("a\u200db", "\u200d"), ("\u200d💻", "\u200d"), ("💻\u200d", "\u200d"),
                         ("binf\ufe0f", "\ufe0f"), ("\ufe0f", "\ufe0f"), ("a\u200d\u200db", "\u200d")):
        assert first_hidden(text, emoji=True) == hidden, text
    assert first_hidden("👩‍💻") == "\u200d"  # where no emoji is expected, none joins
    assert escaped("binf\u3164 \x1b") == "binf\\u3164 \\x1b"
