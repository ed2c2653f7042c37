"""kiln_ops.output: what kiln admin prints, as a person and a script read it."""

import csv
import io

from kiln_ops.output import render


def _printed(rows, columns, fmt):
    lines: list[str] = []
    render(rows, columns, fmt, lines.append)
    return "\n".join(lines) + "\n"


def test_a_csv_cell_holding_a_line_separator_stays_in_its_row():
    """Python's csv writer does not quote U+2028, U+0085, VT or FF (no CSV reader ends a row on
    them): printed line by line as str.splitlines cut it, the rest of the cell became a row of
    its own, past the formula guard."""
    rows = [{"model": "gpt\u2028=1+2", "cost": 1}, {"model": "a\x0bb\x0cc\x85d", "cost": 2}]
    text = _printed(rows, ("model", "cost"), "csv")
    assert list(csv.reader(io.StringIO(text))) == [["model", "cost"], ["gpt\u2028=1+2", "1"], ["a\x0bb\x0cc\x85d", "2"]]


def test_a_table_shows_control_and_invisible_characters_escaped():
    """A terminal runs an escape sequence, and a newline makes a row of its own: a table shows
    each such character as its escape, so that a name cannot pass for other text."""
    rows = [{"model": "\x1b[31mred\nTOTAL  999", "cost": 1}, {"model": "a\u202eb\u2028c", "cost": 2}]
    text = _printed(rows, ("model", "cost"), "table")
    assert "\x1b" not in text and "\u202e" not in text and "\u2028" not in text
    assert len(text.splitlines()) == 3
    assert "\\x1b[31mred\\nTOTAL  999" in text and "a\\u202eb\\u2028c" in text
    assert "café ✓ 👩\u200d💻" in _printed([{"model": "café ✓ 👩\u200d💻"}], ("model",), "table")


def test_a_table_shows_invisible_letters_and_marks_escaped_but_emoji_sequences_whole():
    """A label stored before labels were held to it: a Hangul filler, a variation selector after a
    letter, a joiner between letters are shown as escapes; the same characters in emoji, not."""
    rows = [{"label": "binf\u3164"}, {"label": "binf\ufe0f"}, {"label": "bin\u200df"}, {"label": "❤️‍🔥 1️⃣"}]
    text = _printed(rows, ("label",), "table")
    assert "binf\\u3164" in text and "binf\\ufe0f" in text and "bin\\u200df" in text
    assert "❤️‍🔥 1️⃣" in text
