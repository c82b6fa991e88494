"""The kvstore command's help: every option that has a default says what it is."""

from __future__ import annotations

import argparse

from kvstore.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "kvstore") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _parsers(child, f"{path} {name}")
    return found


def test_every_option_with_a_default_shows_it() -> None:
    parsers = _parsers(build_parser())
    assert any(path == "kvstore bench offload" for path, _ in parsers)
    for path, parser in parsers:
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            shown = parser.formatter_class(path)._get_help_string(action)  # type: ignore[attr-defined]
            assert "default" in shown, f"{path} {action.option_strings[0]} does not show its default"
    assert "(default: 32768)" in dict(parsers)["kvstore bench pool"].format_help()
