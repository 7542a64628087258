"""`sluice status [--admin URL]`: the status page's document, printed for a terminal.

Reads `/admin/state` once (a 5 s timeout) and prints the same sections as the page, colour
first and worst first, units on every number (`--json` prints the document as it came).
Exit status: 0 when the gateway answered, 1 when it did not.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from gateway.core.status import rank

ANSI = {"green": "\033[1;97;42m", "yellow": "\033[1;30;43m", "red": "\033[1;97;41m"}
ORDER = ["limits", "backends", "rejections", "rollout", "datapath", "policy", "routes"]
SKIP = {"now", "colour", "reasons", "history", "gateway", "series"}  # series: the charts'


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin", default="http://127.0.0.1:9901", help="the gateway's admin listener URL"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON document as is")


def run(args: argparse.Namespace) -> int:
    url = args.admin.rstrip("/") + "/admin/state"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            doc = json.loads(r.read())
    except (OSError, ValueError) as e:
        if isinstance(e, urllib.error.HTTPError):
            e.close()
        print(f"sluice status: no answer from {url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc, colour=sys.stdout.isatty()))
    return 0


def fmt(key: str, v: Any) -> str:
    """One value with its unit, read from its key (the same rules as status.js)."""
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return ", ".join(fmt(key, x) for x in v) or "-"
    if isinstance(v, Mapping):
        return ", ".join(f"{k}: {fmt(k, x)}" for k, x in v.items()) or "-"
    if not isinstance(v, int | float):
        return str(v)
    if key in ("t", "at") or key.endswith("_at"):
        return datetime.fromtimestamp(v, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if key.endswith("_ms"):
        return f"{v:.0f} ms"
    if key.endswith("_s"):
        return duration(v)
    if key.endswith("_bytes"):
        return f"{v:.0f} B"
    if "util" in key or key in ("pressure", "load") or key.endswith(("_ratio", "_fraction")):
        return f"{v * 100:.0f} %"
    if "qps" in key or key.endswith(("_rps", "per_s")):
        return f"{v:.1f} /s"
    n = f"{v:g}"
    for part, unit in (("in_flight", "req"), ("waiting", "req"), ("connections", "conn"),
                       ("idle", "conn"), ("errors", "err"), ("recent", "req"), ("total", "req"),
                       ("reloads", "reloads")):  # fmt: skip
        if key.endswith(part):
            return f"{n} {unit}"
    return n


def duration(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def render(doc: Mapping[str, Any], colour: bool = False) -> str:
    def paint(c: str) -> str:
        label = f" {str(c).upper()} "
        return f"{ANSI.get(str(c), '')}{label}\033[0m" if colour and c in ANSI else label

    gw, pol = doc.get("gateway", {}), doc.get("policy", {})
    stage = doc.get("rollout", {}).get("stage") if isinstance(doc.get("rollout"), dict) else None
    ports = " ".join(
        f"{x['name']}={x.get('host', '')}:{x['port']}" for x in gw.get("listeners", [])
    )
    out = [
        f"{paint(doc.get('colour', 'grey'))} sluice {gw.get('version', '?')} pid "
        f"{gw.get('pid', '?')} · {gw.get('state', '?')} · {fmt('in_flight', gw.get('in_flight'))}"
        f" in flight · policy {pol.get('version', '?')}"
        + (f" (rollout: {stage})" if stage else "")
        + f" · up {fmt('uptime_s', gw.get('uptime_s'))} · {ports}"
    ]
    out += [f"  ! {r}" for r in doc.get("reasons", [])]
    hist = doc.get("history", [])
    if hist:
        marks = "".join(str(h.get("colour", "?"))[:1].upper() for h in hist[-60:])
        out.append(f"  history (5 s marks, oldest first): {marks}")
    keys = [k for k in doc if k not in SKIP]
    keys.sort(key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))
    for key in keys:
        value = doc[key]
        head = paint(value["colour"]) + " " if isinstance(value, dict) and "colour" in value else ""
        out.append(f"\n{head}{key}")
        out += _section(value, "  ", paint)
    return "\n".join(out)


def _section(value: Any, indent: str, paint: Any) -> list[str]:
    if _rows(value):
        return _table(value, indent, paint)
    if not isinstance(value, Mapping):
        return [f"{indent}{fmt('', value)}"]
    lines = []
    for k, v in value.items():
        if k in ("colour", "history"):
            continue
        if _rows(v):
            lines.append(f"{indent}{k}:")
            lines += _table(v, indent + "  ", paint)
        elif isinstance(v, Mapping) and len(v) > 4:
            lines.append(f"{indent}{k}:")
            lines += _section(v, indent + "  ", paint)
        else:
            lines.append(f"{indent}{k}: {fmt(k, v)}")
    return lines


def _rows(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)


def _table(rows: list[Mapping[str, Any]], indent: str, paint: Any) -> list[str]:
    rows = sorted(rows, key=lambda r: -rank(r.get("colour", "green")))
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and not _rows(r[k])]
    first = ["colour", "name", "address"]
    cols.sort(key=lambda c: first.index(c) if c in first else len(first))
    cells = [[paint(r[c]) if c == "colour" else fmt(c, r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(_plain(row[i])) for row in cells)) for i, c in enumerate(cols)]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    for row in cells:
        pad = [x + " " * (w - len(_plain(x))) for x, w in zip(row, widths, strict=True)]
        lines.append(indent + "  ".join(pad))
    for r in rows:  # nested lists (a backend's members) follow their table
        for k, v in r.items():
            if _rows(v):
                lines.append(f"{indent}{r.get('name', '')} {k}:")
                lines += _table(v, indent + "  ", paint)
    return lines


def _plain(s: str) -> str:
    return re.sub(r"\033\[[0-9;]*m", "", s)
