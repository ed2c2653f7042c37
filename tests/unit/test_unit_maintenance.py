"""kiln.maintenance: the SSM flag and the 503 it produces (contract §6)."""

import json
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime

import pytest

from kiln.maintenance import MaintenanceFlag, parse_flag

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("raw", [None, "", "   \n"])
def test_missing_parameter_means_no_maintenance(raw):
    assert parse_flag(raw) == MaintenanceFlag()
    assert parse_flag(raw).enabled is False


@pytest.mark.parametrize(
    "raw", ["{not json", "[1, 2]", '"enabled"', '{"enabled": true, "until": "tomorrow"}',
            # a switch written by hand that says neither on nor off
            '{"enabled": "yes please"}', '{"enabled": 2}', '{"enabled": [true]}',
            # an until with no time in UTC (past year 9999 or before year 1 there)
            '{"enabled": true, "until": "9999-12-31T23:59:59-05:00"}',
            '{"enabled": true, "until": "0001-01-01T00:00:00+01:00"}']
)
def test_malformed_flag_is_an_error(raw):
    with pytest.raises(ValueError):
        parse_flag(raw)


def test_valid_flag_is_parsed():
    flag = parse_flag('{"enabled": true, "until": "2026-12-01T03:00:00Z", "message": "Upgrading."}')
    assert flag.enabled is True
    assert flag.until == datetime(2026, 12, 1, 3, 0, tzinfo=timezone.utc)
    assert flag.message == "Upgrading."


@pytest.mark.parametrize("until", ["2026-12-01T03:00:00+00:60", "2026-12-01T03:00:00-0075", "2026-12-01T03:00:00+01:00:61"])
def test_an_until_whose_offset_runs_past_59_is_malformed_not_another_time(until):
    """Python's reading carries +00:60 into +01:00: the switch would end an hour from what was written."""
    with pytest.raises(ValueError, match="past 59"):
        parse_flag(json.dumps({"enabled": True, "until": until}))
    assert parse_flag(json.dumps({"enabled": True, "until": "2026-12-01T03:00:00+01:00:59"})).until == \
        datetime(2026, 12, 1, 1, 59, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize("until", [1798761600, 1.5, True, ["2026-12-01T03:00:00Z"], {"at": "x"}])
def test_an_until_that_is_no_text_makes_the_switch_unreadable_as_an_until_that_is_no_time(until):
    """A number was dropped: the switch served on with no until (Retry-After 60), where an until
    written as text that is no time makes the switch unreadable, its last value kept."""
    with pytest.raises(ValueError, match="must be an ISO 8601 time"):
        parse_flag(json.dumps({"enabled": True, "until": until}))
    assert parse_flag(json.dumps({"enabled": True, "until": None})).until is None  # null: no until


def test_disabled_flag_and_zone_less_until_is_utc():
    flag = parse_flag('{"enabled": false, "until": "2026-12-01T03:00:00"}')
    assert flag.enabled is False
    assert flag.until == datetime(2026, 12, 1, 3, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("year", [2026, 999, 226, 1, 9999])
def test_to_json_round_trips_through_parse_flag(year):
    """Whatever year an operator typed (0226 for 2026), the switch written is one every reader
    reads: a year below 1000 once went out as "226-…", which no reader took, so the switch
    said on was off."""
    flag = MaintenanceFlag(True, datetime(year, 12, 1, 3, 0, tzinfo=timezone.utc), "Back soon")
    assert parse_flag(flag.to_json()) == flag


def test_a_switch_written_with_a_fraction_keeps_it():
    """`kiln admin maintenance on --until …T03:00:00.5Z` wrote 03:00:00, and Retry-After named the
    second before `until`: the fraction is kept, so the answer names 03:00:01 (operations.md)."""
    flag = MaintenanceFlag(True, datetime(2027, 1, 1, 3, 0, 0, 500000, tzinfo=timezone.utc))
    assert parse_flag(flag.to_json()) == flag
    assert parse_flag(flag.to_json()).error(60, now=NOW).headers == {"Retry-After": "Fri, 01 Jan 2027 03:00:01 GMT"}
    assert json.loads(MaintenanceFlag(True, datetime(2027, 1, 1, 3, tzinfo=timezone.utc)).to_json())["until"] == \
        "2027-01-01T03:00:00Z"  # a whole second is written as before


def test_future_until_gives_http_date_retry_after():
    error = parse_flag('{"enabled": true, "until": "2026-12-01T03:00:00Z", "message": "Upgrading."}').error(60, now=NOW)
    assert error.status == 503 and error.code == "maintenance"
    assert error.headers == {"Retry-After": "Tue, 01 Dec 2026 03:00:00 GMT"}
    assert error.message == "Upgrading."


@pytest.mark.parametrize("until, said", [
    ("2026-12-01T03:00:00.750Z", "Tue, 01 Dec 2026 03:00:01 GMT"),
    ("2026-12-24T03:00:00.000001+01:00", "Thu, 24 Dec 2026 02:00:01 GMT"),
    ("9999-12-31T23:59:59.5Z", "Fri, 31 Dec 9999 23:59:59 GMT"),  # no later second to name
])
def test_a_retry_after_date_is_never_before_until(until, said):
    """§6: an HTTP-date names whole seconds; `until` with a fraction was cut to the second
    before it, so a client that waited as told came back during the maintenance."""
    error = parse_flag(json.dumps({"enabled": True, "until": until})).error(60, now=NOW)
    assert error.headers == {"Retry-After": said}


def test_until_with_offset_is_converted_to_gmt():
    error = parse_flag('{"enabled": true, "until": "2026-12-01T12:00:00+09:00"}').error(60, now=NOW)
    retry_after = error.headers["Retry-After"]
    assert retry_after.endswith(" GMT")
    assert parsedate_to_datetime(retry_after) == datetime(2026, 12, 1, 3, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("until", [None, NOW - timedelta(minutes=1), NOW])
def test_absent_or_past_until_gives_default_seconds(until):
    error = MaintenanceFlag(True, until).error(120, now=NOW)
    assert error.headers == {"Retry-After": "120"}
    assert error.message  # a default message, never empty


def test_error_uses_the_current_time_by_default():
    far = MaintenanceFlag(True, datetime(2999, 1, 1, tzinfo=timezone.utc)).error(30)
    assert parsedate_to_datetime(far.headers["Retry-After"]).year == 2999
    past = MaintenanceFlag(True, datetime(2000, 1, 1, tzinfo=timezone.utc)).error(30)
    assert past.headers["Retry-After"] == "30"


def test_an_until_is_held_in_utc_so_every_answer_can_be_written():
    flag = parse_flag('{"enabled": true, "until": "9999-12-31T18:59:59-05:00"}')
    assert flag.until == datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)
    assert flag.error(60, now=NOW).retry_after == "Fri, 31 Dec 9999 23:59:59 GMT"


@pytest.mark.parametrize("written, meant", [
    ("true", True), ("false", False), ('"true"', True), ('"False"', False), ('" on "', True), ('"off"', False),
    ("1", True), ("0", False), ("1.0", True), ('"1"', True), ('"1.0"', True), ('"yes"', True), ('"No"', False),
    ("null", False)])
def test_a_switch_written_by_hand_means_what_it_says(written, meant):
    """Read as off, "true" would be the switch ignored; read as malformed, "false" would keep
    every warm environment on its last value (on) after the operator turned it off."""
    assert parse_flag('{"enabled": %s}' % written).enabled is meant
