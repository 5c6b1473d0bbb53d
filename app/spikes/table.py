"""`steadyserve spikes --url URL`: a server's recent slow-request reports as a table.

Reads GET /debug/slow (bearer token from `--token`, else `STEADY_DEBUG_TOKEN` through the
settings) and prints one row per report, newest first: when, the request, its total, its top
causes and the top cause's evidence.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from app.settings import Settings

COLUMNS = ("at", "request", "status", "total ms", "causes (ms)", "evidence")


def fetch_reports(url: str, token: str | None, limit: int, timeout_s: float = 10.0) -> Any:
    request = urllib.request.Request(f"{url.rstrip('/')}/debug/slow?limit={limit}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def _row(report: Mapping[str, Any]) -> list[str]:
    causes = report.get("causes", [])
    return [
        str(report["at"]).replace("T", " ").removesuffix("Z"),
        f"{report['request']['method']} {report['request']['path']}",
        str(report["request"]["status"]),
        f"{report['total_ms']:.1f}",
        ", ".join(f"{c['cause']} {c['ms']:.0f}" for c in causes[:3]) or "-",
        causes[0]["evidence"] if causes else "",
    ]


def render_table(body: Mapping[str, Any]) -> str:
    """The reports of a /debug/slow answer as an aligned text table."""
    reports: Sequence[Mapping[str, Any]] = body.get("reports", [])
    header = (
        f"front end pid {body.get('frontend_pid')}, slow past {body.get('threshold_ms')} ms: "
        f"{len(reports)} report(s), newest first"
    )
    if not reports:
        return header + "\n(no slow requests)"
    rows = [list(COLUMNS), *(_row(r) for r in reports)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = [header]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The command line `main` runs; SystemExit (status 2) on a usage error."""
    parser = argparse.ArgumentParser(prog="steadyserve spikes", description=__doc__)
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--token", help="debug bearer token (default: STEADY_DEBUG_TOKEN)")
    parser.add_argument("--limit", type=int, default=20, help="reports to show (newest)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_arguments(argv)
    token = args.token or Settings().debug_token
    try:
        body = fetch_reports(args.url, token, args.limit)
    except urllib.error.HTTPError as error:
        print(
            f"{args.url}/debug/slow answered {error.code}: {error.read().decode(errors='replace')}"
        )
        return 1
    except (urllib.error.URLError, OSError) as error:
        print(f"cannot reach {args.url}: {error}")
        return 1
    print(json.dumps(body, indent=2) if args.json else render_table(body))
    return 0
