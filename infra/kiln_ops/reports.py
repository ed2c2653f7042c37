"""Usage reports for `kiln admin usage`: the layer's aggregation (`kiln.usage_report`), which
`GET /v1/usage` shares, so the two always agree."""

from kiln.usage_report import GROUPINGS, Summary, in_span, parse_time, summarize

__all__ = ["GROUPINGS", "Summary", "in_span", "parse_time", "summarize"]
