"""`sluice ebpf attach|status|detach --iface IF`: the classifier by hand, outside the gateway."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["attach", "status", "detach"])
    parser.add_argument("--iface", required=True, help="network interface")
    parser.add_argument("--netns", default=None, help="named network namespace (ip netns)")
    parser.add_argument("--policy", default=None, help="policy file: budgets, ports, table sizes")
    parser.add_argument("--no-egress", action="store_true", help="attach on ingress only")
    parser.add_argument("--json", action="store_true", help="status as JSON")


def _datapath_policy(path: str | None) -> Any:
    from gateway.policy.model import Datapath

    if path is None:
        return Datapath()
    import yaml

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    return Datapath.model_validate(doc.get("datapath") or {})


def status(iface: str, netns: str | None = None) -> dict[str, Any]:
    """Attachment, global counters, top flows and sources (from the pinned maps)."""
    from gateway.datapath.loader import BpfProgram, attachment
    from gateway.datapath.maps import Maps
    from gateway.errors import DatapathError

    out: dict[str, Any] = {"iface": iface, "netns": netns, "attached": attachment(iface, netns)}
    try:
        prog = BpfProgram.open_pinned(iface, netns)
    except DatapathError as exc:
        out["maps"] = str(exc)
        return out
    try:
        m = Maps(prog)
        out["pinned"] = str(prog.pin_dir)
        out["stats"] = m.stats()
        flows = sorted(m.flows(), key=lambda f: f.bytes, reverse=True)
        out["flows"] = [f.__dict__ for f in flows[:20]]
        out["flow_count"] = len(flows)
        out["sources"] = [s.__dict__ for s in m.sources()[:50]]
        out["denied"] = m.denied()
    finally:
        prog.close()
    return out


def run(args: argparse.Namespace) -> int:
    from gateway.datapath.loader import BpfProgram, detach
    from gateway.datapath.maps import Maps, build_options
    from gateway.errors import DatapathError

    try:
        if args.action == "attach":
            dp = _datapath_policy(args.policy)
            prog = BpfProgram(
                args.iface,
                netns=args.netns,
                options=build_options(dp),
                egress=dp.egress and not args.no_egress,
            )
            prog.load()
            Maps(prog).apply_policy(dp)
            prog.attach()
            print(f"attached to {args.iface}" + (f" (maps in {prog.pin_dir})" if prog.pin_dir
                                                 else " (maps not pinned: no bpffs)"))  # fmt: skip
            prog.close()
        elif args.action == "detach":
            was = detach(args.iface, args.netns)
            print(f"detached from {args.iface}" if was else f"nothing attached to {args.iface}")
        else:
            st = status(args.iface, args.netns)
            if args.json:
                print(json.dumps(st, indent=2, sort_keys=True))
            else:
                print(f"{args.iface}: ingress={st['attached']['ingress']} "
                      f"egress={st['attached']['egress']}")  # fmt: skip
                for k, v in (st.get("stats") or {}).items():
                    print(f"  {k:20} {v}")
                if "maps" in st:
                    print(f"  maps: {st['maps']}")
                for f in st.get("flows", []):
                    print("  flow {src}:{sport} -> {dst}:{dport} pkts={packets} bytes={bytes} "
                          "HEADERS={headers} DATA={data} RST={rst_stream} PING={ping} "
                          "blocked={blocked} ({reason})".format(**f))  # fmt: skip
    except DatapathError as exc:
        print(f"sluice ebpf {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0
