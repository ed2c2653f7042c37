"""kiln.shown: which characters of a name shown to people could pass for other text."""

from __future__ import annotations

import unicodedata

import regex

from kiln import shown
from kiln.shown import escaped, first_hidden


def _every_char():
    for point in range(0x110000):
        if not 0xD800 <= point <= 0xDFFF:  # no text holds a lone surrogate
            yield chr(point)


def test_the_default_ignorable_table_is_unicodes():
    """Every code point the `regex` module holds Default_Ignorable (Unicode's renderers show as
    nothing) is hidden, and none it does not is but controls, separators, format characters (of
    this Python's Unicode, which may be older than regex's) and the blank braille pattern."""
    ignorable = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    for char in _every_char():
        expected = bool(ignorable.match(char)) or unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp") or char == "\u2800"
        assert (first_hidden(char) is not None) == expected, f"U+{ord(char):04X}"


def test_the_pictographic_table_is_unicodes():
    pictographic = regex.compile(r"\p{Extended_Pictographic}")
    for char in _every_char():
        assert shown._pictographic(char) == bool(pictographic.match(char)), f"U+{ord(char):04X}"


# emoji sequences people type, and the scripts that shape with joiners and selectors
SHAPED = ("👩‍💻", "❤️", "❤️‍🔥", "👩🏽‍💻", "1️⃣", "#️⃣", "‼️", "🏳️‍🌈", "ℹ️", "🙂‍↔️", "🏃‍♀️", "👁️‍🗨️", "👨‍👩‍👧",
          "🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",  # England's flag, of tags
          "ශ්‍රී", "മന്‍", "می\u200cخواهم", "ᠠ\u180b",
          "\u09b0\u200d\u09cd\u09af",  # Bengali ra-phala: a joiner before the virama
          "\u1830\u1820\u1837\u180e\u1820",  # Mongolian, with its vowel separator
          "\u0645\u064e\u200c\u0628")  # Persian: a non-joiner after a vowel sign
# the same characters where they show nothing: each name would pass for another
UNSHAPED = (("a\u200db", "\u200d"), ("\u200d💻", "\u200d"), ("💻\u200d", "\u200d"), ("binf\ufe0f", "\ufe0f"),
            ("prod1\ufe0f", "\ufe0f"), ("prod-\ufe0fa", "\ufe0f"), ("\ufe0f", "\ufe0f"), ("★\u200d★", "\u200d"),
            ("a\u200cb", "\u200c"), ("x\U000e0100", "\U000e0100"), ("flag\U000e0067\U000e007f", "\U000e0067"),
            ("binf\u3164", "\u3164"), ("bi\u17b4nf", "\u17b4"), ("binf\u2800", "\u2800"),
            # a variation selector after an ideograph (which are registered is more data than a label needs)
            ("团\ufe0f队", "\ufe0f"), ("团\U000e0100队", "\U000e0100"),
            # tags that spell no flag: hidden text, a tag flag of one letter, a cancel tag further on
            ("\U0001f3f4" + "".join(chr(0xE0000 + ord(c)) for c in "ignore all") + "\U000e007f", "\U000e0069"),
            ("\U0001f3f4\U000e0061\U000e007f", "\U000e0061"),
            ("\U0001f3f4" + "".join(chr(0xE0000 + ord(c)) for c in "admin99") + "\U000e007f", "\U000e0061"),
            ("\u1820\u180e", "\u180e"),  # Mongolian's vowel separator with no letter after it
            ("a\u200d\u094d", "\u200d"),  # a joiner before a virama, after no Indic letter
            ("\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074 x\U000e007f", "\U000e0067"))


def test_joiners_and_selectors_are_hidden_only_where_they_shape_nothing():
    for text in SHAPED:
        assert first_hidden(text, emoji=True) is None, ascii(text)
        assert escaped(text) == text
    for text, hidden in UNSHAPED:
        assert first_hidden(text, emoji=True) == hidden, ascii(text)
    assert first_hidden("👩‍💻") == "\u200d"  # where no emoji is expected, none joins
    assert escaped("binf\u3164 \x1b") == "binf\\u3164 \\x1b"
