"""Turn the points of an enumeration run into docs/storage-faults.md:

    REGEN_FAULT_TABLE=/tmp/points.json pytest tests/test_enumerated_faults.py
    python -m tests.fault_table /tmp/points.json   # prints the tables
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

OUTCOME = {"ok": "ok", "logged": "logged", "error": "error", "error?": "error, may be done", "interrupt": "interrupt",
           "killed": "killed"}
POSIX_COLUMNS = [("EIO·ENOSPC·EACCES", "once"), ("EIO·ENOSPC·EACCES", "outage"), ("short", "once"),
                 ("interrupt", "once"), ("SIGKILL", "once")]
S3_COLUMNS = [("500", "retried"), ("500", "no retry"), ("500", "outage"), ("403", "retried"), ("503", "no retry"),
              ("reset", "outage"), ("interrupt", "once"), ("SIGKILL", "once")]
HEADERS = {("EIO·ENOSPC·EACCES", "once"): "EIO · ENOSPC · EACCES", ("EIO·ENOSPC·EACCES", "outage"): "… from then on",
           ("short", "once"): "short write", ("interrupt", "once"): "2nd SIGINT", ("SIGKILL", "once"): "SIGKILL",
           ("500", "retried"): "500", ("500", "no retry"): "500, retries out", ("500", "outage"): "500 from then on",
           ("403", "retried"): "403", ("503", "no retry"): "503, retries out", ("reset", "outage"): "reset from then on"}
SCENARIOS = ["data commit", "failure commit", "index segment", "hidden part", "prompt set", "run.json", "status.json", "lock/lease"]
# what an S3 request or a seam primitive is, in the table's words
PRIMITIVE = {"LIST": "list", "HEAD": "stat", "GET": "read", "PUT": "upload", "PUT-MARKER": "folder marker of",
             "COPY": "copy (publish)", "DELETE": "delete",
             "link": "link (publish)", "rename": "rename (publish)", "copy": "copy (publish)", "fsync_dir": "fsync folder"}


def label(call: str) -> str:
    op, _, path = call.partition(" ")
    name = re.sub(r"\.parquet|\.json|-\*|\.\*", "", path.replace("e0-n0-0-", "")).strip("/") or "."
    return f"{PRIMITIVE.get(op, op)} {name}".strip()


def table(points: list[dict], backend: str, columns: list[tuple[str, str]]) -> str:
    cells: dict[tuple[str, str], dict[tuple[str, str], set[str]]] = defaultdict(lambda: defaultdict(set))
    order: dict[str, list[str]] = defaultdict(list)
    for p in points:
        if p["backend"] != backend or p["call"].startswith("(no"):
            continue
        fault = "EIO·ENOSPC·EACCES" if p["fault"] in ("EIO", "ENOSPC", "EACCES") else p["fault"]
        row = label(p["call"])
        if row not in order[p["scenario"]]:
            order[p["scenario"]].append(row)
        cells[(p["scenario"], row)][(fault, p["mode"])].add(OUTCOME[p["outcome"]])
    lines = ["| operation | I/O call | " + " | ".join(HEADERS[c] for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for scenario in SCENARIOS:
        for i, row in enumerate(order[scenario]):
            values = [" / ".join(sorted(cells[(scenario, row)].get(c, ()))) or "·" for c in columns]
            lines.append(f"| {scenario if i == 0 else ''} | {row} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(source: str) -> None:
    """Prints the tables (markdown) for docs/storage-faults.md."""
    points = json.load(open(source))
    counts = {backend: sum(p["backend"] == backend for p in points) for backend in ("POSIX", "S3")}
    print(f"{counts['POSIX']} points on POSIX, {counts['S3']} on S3.\n\n### POSIX\n\n{table(points, 'POSIX', POSIX_COLUMNS)}"
          f"\n\n### S3\n\n{table(points, 'S3', S3_COLUMNS)}")


if __name__ == "__main__":
    main(sys.argv[1])
