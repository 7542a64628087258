"""`sluice --help` and every command's and action's --help print whole descriptions."""

from __future__ import annotations

import pytest

from gateway.cli import COMMANDS, main

POLICY_ACTIONS = ("check", "schema", "diff", "apply", "rollout", "checksum")


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def description(text: str) -> str:
    """The paragraph after the usage lines, unwrapped."""
    paragraphs = text.split("\n\n")
    return " ".join(paragraphs[1].split())


def test_the_top_help_is_whole_sentences(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys)
    first = description(text)
    assert first.endswith("."), first
    assert "Sluice" in first
    assert "sluice COMMAND --help" in text
    for name, (_, help_text) in COMMANDS.items():
        assert name in text and " ".join(help_text.split()) in " ".join(text.split())


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_describes_itself(capsys: pytest.CaptureFixture[str], command: str) -> None:
    assert description(help_of(capsys, command)) == COMMANDS[command][1]


@pytest.mark.parametrize("action", POLICY_ACTIONS)
def test_each_policy_action_describes_itself(
    capsys: pytest.CaptureFixture[str], action: str
) -> None:
    text = description(help_of(capsys, "policy", action))
    assert text and not text.startswith(("options:", "positional arguments:")), text
