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


def _ranges(text: str) -> tuple[tuple[int, int], ...]:
    """'00A9 2194-2199 …' as ((0xA9, 0xA9), (0x2194, 0x2199), …)."""
    pairs = []
    for item in text.split():
        first, _, last = item.partition("-")
        pairs.append((int(first, 16), int(last or first, 16)))
    return tuple(pairs)


# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): what a renderer that does
# not know a character better shows as nothing, whatever its category (the Hangul fillers are
# letters, the variation selectors and the combining grapheme joiner marks).
_IGNORABLE = _ranges("""
    00AD 034F 061C 115F-1160 17B4-17B5 180B-180F 200B-200F 202A-202E 2060-206F 3164 FE00-FE0F FEFF
    FFA0 FFF0-FFF8 1BCA0-1BCA3 1D173-1D17A E0000-E0FFF
""")
# Unicode's Extended_Pictographic (emoji-data.txt): what emoji sequences are made of.
_PICTOGRAPHIC = _ranges("""
    00A9 00AE 203C 2049 2122 2139 2194-2199 21A9-21AA 231A-231B 2328 23CF 23E9-23F3 23F8-23FA 24C2
    25AA-25AB 25B6 25C0 25FB-25FE 2600-2604 260E 2611 2614-2615 2618 261D 2620 2622-2623 2626 262A
    262E-262F 2638-263A 2640 2642 2648-2653 265F-2660 2663 2665-2666 2668 267B 267E-267F 2692-2697 2699
    269B-269C 26A0-26A1 26A7 26AA-26AB 26B0-26B1 26BD-26BE 26C4-26C5 26C8 26CE-26CF 26D1 26D3-26D4
    26E9-26EA 26F0-26F5 26F7-26FA 26FD 2702 2705 2708-270D 270F 2712 2714 2716 271D 2721 2728 2733-2734
    2744 2747 274C 274E 2753-2755 2757 2763-2764 2795-2797 27A1 27B0 27BF 2934-2935 2B05-2B07 2B1B-2B1C
    2B50 2B55 3030 303D 3297 3299 1F004 1F02C-1F02F 1F094-1F09F 1F0AF-1F0B0 1F0C0 1F0CF-1F0D0
    1F0F6-1F0FF 1F170-1F171 1F17E-1F17F 1F18E 1F191-1F19A 1F1AF-1F1E5 1F201-1F20F 1F21A 1F22F
    1F232-1F23A 1F23C-1F23F 1F249-1F25F 1F266-1F321 1F324-1F393 1F396-1F397 1F399-1F39B 1F39E-1F3F0
    1F3F3-1F3F5 1F3F7-1F3FA 1F400-1F4FD 1F4FF-1F53D 1F549-1F54E 1F550-1F567 1F56F-1F570 1F573-1F57A
    1F587 1F58A-1F58D 1F590 1F595-1F596 1F5A4-1F5A5 1F5A8 1F5B1-1F5B2 1F5BC 1F5C2-1F5C4 1F5D1-1F5D3
    1F5DC-1F5DE 1F5E1 1F5E3 1F5E8 1F5EF 1F5F3 1F5FA-1F64F 1F680-1F6C5 1F6CB-1F6D2 1F6D5-1F6E5 1F6E9
    1F6EB-1F6F0 1F6F3-1F6FF 1F7DC-1F7F0 1F80C-1F80F 1F848-1F84F 1F85A-1F85F 1F888-1F88F 1F8AE-1F8AF
    1F8BC-1F8BF 1F8C2-1F8CF 1F8D9-1F8FF 1F90C-1F93A 1F93C-1F945 1F947-1F9FF 1FA58-1FA5F 1FA6E-1FAFF
    1FC00-1FFFD
""")
# Both tables are held to the `regex` module's properties by tests.

# a blank that is no space: the braille pattern of no dots
_BLANKS = frozenset({"\u2800"})
_ZWJ, _ZWNJ = "\u200d", "\u200c"
_PRESENTATION = frozenset({"\ufe0e", "\ufe0f"})  # text or emoji presentation of the character before
_KEYCAP = "\u20e3"  # after a digit, # or * and U+FE0F: a keycap emoji
_MODIFIERS = range(0x1F3FB, 0x1F400)  # skin tones
_BLACK_FLAG, _TAG_END = "\U0001f3f4", "\U000e007f"  # a flag of tags: 🏴 tag letters… cancel tag
_TAGS = range(0xE0020, 0xE007F)
_TAG_ID = frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("0"), ord("9") + 1))  # tag a..z, 0..9
_VIRAMA = 9  # the canonical combining class of a virama: a joiner after it shapes the cluster
_MONGOLIAN = range(0x1820, 0x18AB)


def _in(table: tuple[tuple[int, int], ...], char: str) -> bool:
    point = ord(char)
    index = bisect.bisect_right(table, (point, 0x10FFFF)) - 1
    return index >= 0 and table[index][0] <= point <= table[index][1]


def _pictographic(char: str) -> bool:
    return _in(_PICTOGRAPHIC, char)


def _arabic_letter(char: str) -> bool:
    return unicodedata.category(char) == "Lo" and unicodedata.name(char, "").startswith("ARABIC")


def _arabic(char: str) -> bool:
    """An Arabic-script letter, or a mark on one (a vowel sign written after it)."""
    return unicodedata.category(char) in ("Lo", "Mn") and unicodedata.name(char, "").startswith("ARABIC")


def _shaped(text: str, index: int) -> bool:
    """Whether the joiner or selector at `index` does what Unicode made it for, visibly: joins
    emoji into one, selects an emoji's or a keycap's presentation, spells a flag of tags, shapes
    an Indic cluster (a joiner beside a virama), Arabic-script joining (between its letters) or a
    Mongolian letter's form. Anywhere else it shows nothing (a variation selector after an
    ideograph included: which of them are registered variants is more data than a label needs)."""
    char = text[index]
    before = text[index - 1] if index > 0 else ""
    after = text[index + 1] if index + 1 < len(text) else ""
    if char in _PRESENTATION:
        if before in "0123456789#*" and before:
            return after == _KEYCAP
        return bool(before) and _pictographic(before)
    if char == _ZWJ and before and after and _pictographic(after):
        if _pictographic(before) or before in _PRESENTATION or ord(before) in _MODIFIERS:
            return True
    if char in (_ZWJ, _ZWNJ) and before:
        # an Indic cluster: a joiner after a virama, or (Bengali's ra-phala, Sinhala's touching
        # letters) before one
        if unicodedata.combining(before) == _VIRAMA:
            return True
        if after and unicodedata.combining(after) == _VIRAMA and unicodedata.category(before) == "Lo":
            return True
        if after and _arabic(before) and _arabic_letter(after):
            return True
    point = ord(char)
    if 0x180B <= point <= 0x180F:  # Mongolian free variation selectors, and its vowel separator between letters
        shaped = bool(before) and ord(before) in _MONGOLIAN
        return shaped and (point != 0x180E or (bool(after) and ord(after) in _MONGOLIAN))
    if point in _TAGS or char == _TAG_END:
        return _in_tag_flag(text, index)
    return False


def _in_tag_flag(text: str, index: int) -> bool:
    """Whether the tag at `index` is part of a flag of tags: the black flag, a region and
    subdivision id in tag letters and digits (gbsct), the cancel tag right after it."""
    start = end = index
    while start > 0 and ord(text[start - 1]) in _TAGS:
        start -= 1
    while end < len(text) and ord(text[end]) in _TAGS:
        end += 1
    if text[index] == _TAG_END:
        end = index
    spelled = text[start:end]
    return (start > 0 and text[start - 1] == _BLACK_FLAG and end < len(text) and text[end] == _TAG_END
            and 3 <= len(spelled) <= 6 and all(ord(tag) - 0xE0000 in _TAG_ID for tag in spelled))


def _hidden_at(text: str, index: int, emoji: bool) -> bool:
    char = text[index]
    if not (unicodedata.category(char) in _HIDDEN_CATEGORIES or _in(_IGNORABLE, char) or char in _BLANKS):
        return False
    return not (emoji and _shaped(text, index))


def first_hidden(text: str, *, emoji: bool = False) -> str | None:
    """The first character of `text` that hides text, or fakes other text, where it is shown,
    if any; with `emoji` (a label, written by people in their own scripts), the joiners and
    selectors of emoji sequences and of the scripts that shape with them do not."""
    return next((char for index, char in enumerate(text) if _hidden_at(text, index, emoji)), None)


def escaped(text: str) -> str:
    """`text` as a person may read it: each character that would hide or fake text shown as its
    escape (\\u3164), emoji sequences and shaped scripts as they are."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(char.encode("unicode_escape").decode("ascii") if _hidden_at(text, index, True) else char
                   for index, char in enumerate(text))
