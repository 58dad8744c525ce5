"""Usage over any period, summed per key, model or UTC day: JSON or a CSV download.

``GET /admin/v1/usage`` answers per-minute rows for dashboards; billing and
chargeback want a month in a few lines. The sums are the database's
(Store.usage_report), so a month costs one grouped query, not millions of
rows. ``llmgw ctl usage --csv`` and the console's download both fetch the
CSV from here, so the two files are the same bytes.

Cells a person sets (key names) or a client chose (model names reach the
store as asked for) go into a file that is opened in spreadsheets, where a
cell starting with ``=``, ``+``, ``-`` or ``@`` is a formula: such cells are
written with a leading apostrophe (OWASP's advice on CSV injection).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from llmgw.control.adminapi.schemas import USAGE_COUNTERS, UsageCounts
from llmgw.errors import ValidationError

Dimension = Literal["day", "team", "key", "model"]
DIMENSIONS: tuple[Dimension, ...] = ("day", "team", "key", "model")
# Without ``since``: the last 30 days, a billing period. Grouped by day that
# is 30 rows per key and model, however busy the fleet.
DEFAULT_WINDOW_S = 30 * 86400
MAX_TIME = 2**40
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


class UsageReportRow(UsageCounts):
    day: str | None = None  # YYYY-MM-DD, UTC
    # The key's team when the usage happened; "" for the operator's keys.
    team_id: str | None = None
    team_name: str | None = None
    key_id: str | None = None
    key_name: str | None = None
    model: str | None = None


class UsageReport(BaseModel):
    since: int  # unix time, rounded down to its minute
    until: int  # exclusive
    by: list[Dimension]
    rows: list[UsageReportRow] = Field(default_factory=list)
    total: UsageReportRow = Field(default_factory=UsageReportRow)


def parse_by(text: str) -> list[Dimension]:
    """``team``, ``key``, ``model``, ``day`` or several comma-separated (``day,model``)."""
    wanted: list[Dimension] = []
    for part in (p.strip() for p in text.split(",")):
        if part not in DIMENSIONS:
            raise ValidationError(f"by: {part!r} is not one of team, key, model, day", field="by")
        if part not in wanted:
            wanted.append(part)
    return wanted


def build_report(since: int, until: int, by: list[Dimension], rows: Iterable[dict[str, Any]],
                 key_names: dict[str, str], team_names: dict[str, str] | None = None
                 ) -> UsageReport:
    report = UsageReport(since=since, until=until, by=by)
    for row in rows:
        item = UsageReportRow(**{c: row.get(c, 0) for c in USAGE_COUNTERS})
        if "day" in by:
            item.day = datetime.fromtimestamp(row["day_start"], UTC).strftime("%Y-%m-%d")
        if "team" in by:
            item.team_id = row["team_id"] or ""
            item.team_name = (team_names or {}).get(row["team_id"] or "", "")
        if "key" in by:
            item.key_id = row["key_id"]
            item.key_name = key_names.get(row["key_id"], "")
        if "model" in by:
            item.model = row["model"]
        report.rows.append(item)
        report.total.add(row)
    return report


def columns(by: Sequence[Dimension]) -> list[str]:
    named = {"day": ["day"], "team": ["team_id", "team_name"], "key": ["key_id", "key_name"],
             "model": ["model"]}
    return [c for d in by for c in named[d]] + list(USAGE_COUNTERS)


def _cell(value: object) -> object:
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def to_csv(report: UsageReport) -> str:
    """RFC 4180 CSV (CRLF line ends), one header line, one line per row; no total line,
    so that summing a column in a spreadsheet gives the total."""
    out = io.StringIO()
    writer = csv.writer(out)
    names = columns(report.by)
    writer.writerow(names)
    for row in report.rows:
        values = row.model_dump()
        writer.writerow([_cell(values[name]) for name in names])
    return out.getvalue()


def csv_filename(report: UsageReport) -> str:
    def day(t: int) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y%m%dT%H%MZ")

    return f"llmgw-usage-{day(report.since)}-{day(report.until)}-by-{'-'.join(report.by)}.csv"

