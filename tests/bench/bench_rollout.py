"""A failing policy change rolled out under load: how many requests the new policy serves before
the automatic rollback, and how long the rollback takes (not part of the test run; needs wrk).

    .venv/bin/python tests/bench/bench_rollout.py [--duration 12] [--connections 32]
                                                  [--stages shadow,5,25,100] [--hold-s 2]
                                                  [--error-rate 1.0]

Two simulated backends: the good one and one answering 500 to everything (or to a share
`--error-rate` of the requests). The gateway serves
the good one; wrk sends chat completions (POST, JSON body) on `--connections` keep-alive
connections; after 3 s the policy file is changed to route to the failing backend with a
`rollout:` section (the default thresholds: min_requests 50, max_error_rate_increase 0.02) and
reloaded. The script polls `/admin/policy/rollout` until the rollout stops and prints the
rollout's own account (stage, requests served by the new policy, seconds from the start of the
first serving stage to the rollback) beside what wrk saw (requests, non-2xx answers).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from tests.integration.conftest import Backend, policy_yaml  # noqa: E402
from tests.support import Proc, free_port, wait_for_port  # noqa: E402

LUA = """wrk.method = "POST"
wrk.body = '{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
wrk.headers["Content-Type"] = "application/json"
"""


def backend(tmp: Path, *extra: str) -> Backend:
    http, grpc, admin = free_port(), free_port(), free_port()
    args = ["mock-backend", "--http", f"127.0.0.1:{http}", "--grpc", f"127.0.0.1:{grpc}"]
    args += ["--admin", f"127.0.0.1:{admin}"]
    proc = Proc([*args, "--ttft-ms", "2", "--token-delay-ms", "0", *extra], tmp / f"{http}.log")
    wait_for_port(http)
    return Backend(proc, http, grpc, admin)


def get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return json.loads(e.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=12)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--stages", default="shadow,5,25,100")
    ap.add_argument("--hold-s", type=float, default=2.0)
    ap.add_argument(
        "--error-rate", type=float, default=1.0, help="share of the new backend's answers that fail"
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-bench-rollout-"))
    good = backend(tmp)
    fail = ["--failure", "http_5xx"] if args.error_rate >= 1 else []
    bad = backend(tmp, *fail, "--error-rate", f"{min(args.error_rate, 1.0)}")
    procs = [good.proc, bad.proc]
    try:
        http, grpc, admin = free_port(), free_port(), free_port()
        tail = "access_log: {enabled: false}\n"
        text = policy_yaml(good, http, grpc, admin, tail=tail)
        policy = tmp / "policy.yaml"
        policy.write_text(text)
        gw = Proc(["serve", "--policy", str(policy)], tmp / "gateway.log")
        procs.append(gw)
        wait_for_port(admin)
        wait_for_port(http)
        script = tmp / "post.lua"
        script.write_text(LUA)
        wrk = subprocess.Popen(
            ["wrk", "-t1", f"-c{args.connections}", f"-d{args.duration}s", "-s", str(script)]
            + [f"http://127.0.0.1:{http}/v1/chat/completions"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(3)
        stages = ", ".join(args.stages.split(","))
        failing = text.replace(f"127.0.0.1:{good.http_port}", f"127.0.0.1:{bad.http_port}")
        failing += f"rollout: {{stages: [{stages}], hold_s: {args.hold_s}}}\n"
        policy.write_text(failing)
        t0 = time.monotonic()
        req = urllib.request.Request(
            f"http://127.0.0.1:{admin}/admin/policy/reload", data=b"", method="POST"
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 202, r.status
        while True:
            st = get(f"http://127.0.0.1:{admin}/admin/policy/rollout")
            if st.get("phase") not in ("shadow", "serving"):
                break
            if time.monotonic() - t0 > args.duration:
                raise SystemExit(f"no rollback within {args.duration}s: {st}")
            time.sleep(0.05)
        out, _ = wrk.communicate(timeout=args.duration + 30)
        total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
        m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        non2xx = int(m.group(1)) if m else 0
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        stopped = st["stopped"]
        print(f"load: wrk -c{args.connections}, {total} requests, {rps:.0f} req/s")
        print(f"rollout: stages {stages}, hold {args.hold_s:g}s -> {st['phase']} at {st['stage']}")
        print(f"  reason: {stopped['reason']}")
        print(f"  requests served by the new policy: {stopped['new_requests_served']}")
        print(f"  client-seen non-2xx answers (whole run): {non2xx}")
        print(
            "  seconds from the start of the first serving stage to the rollback: "
            f"{stopped['seconds_since_first_serving_stage']}"
        )
        print(f"  seconds from the reload to the rollback: {stopped['seconds']}")
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    main()
