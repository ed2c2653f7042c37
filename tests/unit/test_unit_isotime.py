"""Times people write: Python's ISO 8601 reading, held to the standard's offsets."""

from datetime import datetime, timedelta, timezone

import pytest

from kiln.isotime import from_iso


@pytest.mark.parametrize("text,offset", [("2026-12-01T03:00:00Z", 0), ("2026-12-01T03:00:00+05:30", 330),
                                         ("2026-12-01T03:00:00-0959", -599), ("2026-12-01T03:00:00.25+23:59", 1439),
                                         ("2026-12-01T03:00:00+05", 300), ("20261201T030000+0530", 330),
                                         ("2026-W49-2T03:00:00-01:00", -60), ("2026-12-01 03:00+01:00:30", 60.5)])
def test_an_offset_within_the_standard_is_read_as_python_reads_it(text, offset):
    assert from_iso(text).utcoffset() == timedelta(minutes=offset)


@pytest.mark.parametrize("text", ["2026-12-01T03:00:00+00:60", "2026-12-01T03:00:00-00:99", "2026-12-01T03:00:00+0199",
                                  "2026-12-01T03:00:00+00:00:60", "2026-12-01T03:00:00+00:00:75.5",
                                  # forms Python reads on, once let through: a fraction after the
                                  # minutes, a comma's, a fourth part
                                  "2026-12-01T03:00:00+00:99.5", "2026-12-01T03:00:00+0099.5",
                                  "2026-12-01T03:00:00+00:60,5", "2026-12-01T03:00:00+00:99:00:00",
                                  "2026-12-01T03:00:00+00:00:60,5", "20261201T030000-0075"])
def test_minutes_or_seconds_past_59_in_an_offset_are_no_time(text):
    with pytest.raises(ValueError, match="past 59"):
        from_iso(text)


def test_a_time_with_no_zone_or_only_a_date_is_read_as_python_reads_it():
    assert from_iso("2026-12-01T03:00:00") == datetime(2026, 12, 1, 3)
    assert from_iso("2026-12-01") == datetime(2026, 12, 1)
    assert from_iso("2026-12-01T03:00:00Z").tzinfo == timezone.utc
