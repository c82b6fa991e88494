"""The kvstore command's help: every option that has a default says what it is."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvstore.cli import BENCHMARKS, COMMANDS, build_parser, chosen_command


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


def test_each_command_module_registers_the_name_it_is_listed_under() -> None:
    full = dict(_parsers(build_parser()))
    top = {path.split()[1] for path in full if len(path.split()) == 2}
    assert top == {*COMMANDS, "bench"}
    assert {path.split()[2] for path in full if path.startswith("kvstore bench ")} == set(BENCHMARKS)
    for name in COMMANDS:
        assert {path for path in dict(_parsers(build_parser([name]))) if len(path.split()) == 2} == {f"kvstore {name}"}
    for name in BENCHMARKS:
        paths = dict(_parsers(build_parser(["bench", name])))
        assert {path for path in paths if path.startswith("kvstore bench ")} == {f"kvstore bench {name}"}


@pytest.mark.parametrize(
    ("argv", "chosen"),
    [
        (["router", "--config", "x.toml"], ["router"]),
        (["--log-level", "INFO", "serve"], ["serve"]),
        (["--log-level=INFO", "events", "tail"], ["events"]),
        (["bench", "offload", "--json", "x"], ["bench", "offload"]),
        (["bench", "nosuch"], None),  # the whole parser, to list the benchmarks there are
        (["bench"], None),
        (["nosuch"], None),
        (["--help"], None),
        ([], None),
    ],
)
def test_the_command_line_picks_the_one_command_to_import(argv: list[str], chosen: list[str] | None) -> None:
    assert chosen_command(argv) == chosen


def test_the_router_and_the_event_tools_start_without_torch_or_ray() -> None:
    """Only workers, serve and the benchmarks need torch and Ray; the router process is spared them."""
    probe = (
        "import sys\n"
        "from kvstore.cli import main\n"
        "for argv in (['router', '--help'], ['events', 'tail', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "import kvstore.router.service, kvstore.router.app, kvstore.deploy.config\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_an_unknown_log_level_is_a_usage_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "nope", "events", "tail", "--help"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'NOPE'" in capsys.readouterr().err


def test_a_command_whose_reader_leaves_ends_quietly() -> None:
    """``kvstore ... | head``: a command that writes after its reader left ends with exit 0 and no traceback."""
    import subprocess
    import sys

    probe = (
        "import argparse, sys\n"
        "import kvstore.cli as cli\n"
        "def spew(args):\n"
        "    while True:\n"
        "        print('x' * 4096)\n"
        "def build(chosen):\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--log-level', default='WARNING')\n"
        "    parser.set_defaults(func=spew)\n"
        "    return parser\n"
        "cli.build_parser = build\n"
        "sys.exit(cli.main([]))\n"
    )
    with subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        child.stdout.read(10)
        child.stdout.close()
        errors = child.stderr.read()
        assert child.wait(timeout=30) == 0, errors
    assert b"Traceback" not in errors
