"""`sluice budget show|grant|reset RULE KEY`: read and adjust a token budget of a running
gateway through its admin listener, without a policy reload."""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import quote

from gateway.errors import AdminError


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("show", "a key's budget in the current period"),
        ("grant", "give a key TOKENS more for the current period"),
        ("reset", "set a key's tally for the current period back to zero"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("rule", metavar="RULE", help="the budget's name")
        p.add_argument("key", metavar="KEY", help="the key (parts joined with '|')")
        if name == "grant":
            p.add_argument("tokens", metavar="TOKENS", type=int)
        p.add_argument("--json", action="store_true", help="print the JSON document")
        p.add_argument(
            "--admin", default="127.0.0.1:9901", metavar="HOST:PORT",
            help="the gateway's admin listener (or its URL)",
        )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from gateway.policyctl.remote import call

    base = args.admin if "://" in args.admin else f"http://{args.admin}"
    path = f"/admin/budgets/{quote(args.rule, safe='')}/{quote(args.key, safe='')}"
    method = "GET"
    if args.action == "grant":
        path += f"/grant?tokens={args.tokens}"
        method = "POST"
    elif args.action == "reset":
        path += "/reset"
        method = "POST"
    try:
        code, doc = call(base, path, method)
    except AdminError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    if code != 200:
        err = doc.get("error", {}) if isinstance(doc, dict) else {}
        print(f"sluice: HTTP {code}: {err.get('message', doc)}", file=sys.stderr)
        return 1
    if args.json:
        keys = ("rule", "key", "limit", "used", "reserved", "remaining", "resets_at")
        print(json.dumps({k: doc[k] for k in keys}))
        return 0
    print(
        f"{doc['rule']} [{doc['key']}] period {doc['period']} ({doc['store']}): "
        f"{doc['used']} used + {doc['reserved']} reserved of {doc['limit']}, "
        f"{doc['remaining']} remaining; resets at {doc['resets_at']}"
    )
    return 0
