"""The `sluice` command. Each subcommand lives in its own module, which defines
`configure(parser)` and `run(args) -> int`; modules keep heavy imports (bcc, grpc) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

DESCRIPTION = "Sluice: a traffic-control gateway for LLM inference backends."
EPILOG = "Run `sluice COMMAND --help` for the options of one command."
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.server", "run the gateway"),
    "policy": ("gateway.policyctl.commands", "check, print the schema of, or diff policy files"),
    "mock-backend": ("gateway.mockbackend.commands", "run the simulated inference backend"),
    "bench": ("gateway.bench", "measure Sluice against the backend direct"),
    "ebpf": ("gateway.datapath.commands", "attach, inspect or detach the eBPF TC classifier"),
    "host": ("gateway.hosttune", "plan, apply or roll back host TCP tuning"),
    "heartbeat": ("gateway.registry.agent", "publish a model server's heartbeat to Redis"),
    "status": ("gateway.status.terminal", "print a running gateway's state (what /status shows)"),
    "budget": ("gateway.budgets.commands", "show, grant or reset a token budget of a gateway"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the one being run (`only`) imports its module."""
    parser = argparse.ArgumentParser(prog="sluice", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == only:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    code: int = importlib.import_module(args._module).run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
