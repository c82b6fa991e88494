"""The package layout: one import root in the wheel, and a layering contract that covers the whole core."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kvstore"
LAYERS = frozenset({"benchmarks", "deploy", "router", "tiers", "workers"})
ABOVE_THE_CORE = {"cli", "__main__"}


def _core_modules() -> set[str]:
    """Every module of the kvstore/ folder itself (the layers are symbolic links in it, and not the core)."""
    names = set()
    for path in CORE.iterdir():
        if path.is_symlink():
            continue
        if path.suffix == ".py" and path.stem not in ABOVE_THE_CORE | {"__init__"}:
            names.add(f"kvstore.{path.stem}")
        elif path.is_dir() and (path / "__init__.py").exists():
            names.add(f"kvstore.{path.name}")
    return names


def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvstore-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert top_level == ["kvstore"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"kvstore"}
    for layer in LAYERS:  # the linked folders land under the root, with their modules
        assert f"kvstore/{layer}/__init__.py" in names
    assert "kvstore/benchmarks/data/mooncake_conversation_trace.jsonl" in names


def test_each_layer_folder_is_linked_under_the_import_root() -> None:
    for layer in LAYERS:
        link = CORE / layer
        assert link.is_symlink() and link.resolve() == (ROOT / layer).resolve(), f"kvstore/{layer} -> ../{layer}"


def test_the_core_contract_lists_every_core_module() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (core,) = [c for c in config["contracts"] if c["type"] == "forbidden"]
    assert set(core["source_modules"]) == _core_modules()
    assert {f"kvstore.{layer}" for layer in LAYERS} | {"kvstore.cli", "ray"} <= set(core["forbidden_modules"])


def test_the_core_package_init_imports_only_the_core() -> None:
    # import-linter checks the core modules; the package's own __init__ is checked here.
    tree = ast.parse((CORE / "__init__.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported, "kvstore/__init__.py re-exports the core"
    assert all(
        name.startswith("kvstore.") and name.split(".")[1] not in LAYERS | ABOVE_THE_CORE for name in imported
    ), imported
