"""The model flags of ``kvstore serve``, ``kvstore worker`` and the benchmarks, as config overrides.

``--model PATH`` (``worker.model``) serves a Hugging Face model directory,
``--served-model-name`` (``worker.served_model_name``) renames it, and, for
benchmarks, ``--shape NAME`` (``worker.shape``) runs a real architecture
with seeded random weights. Each flag is only a ``section.field=value``
override placed before the user's ``--set``s, so a config file, the
environment and ``--set`` mean the same things as the flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from kvstore.deploy.config import Config
from kvstore.router.config import RouterConfig
from kvstore.workers.model_source import served_name
from kvstore.workers.shapes import SHAPES


def add_model_arguments(parser: argparse.ArgumentParser, *, shapes: bool = False) -> None:
    """Add ``--model`` and ``--served-model-name`` (and ``--shape`` when ``shapes``) to ``parser``."""
    model_help = "Hugging Face model directory to serve (worker.model); default: the toy model"
    parser.add_argument("--model", default=None, metavar="PATH", help=model_help)
    name_help = "name clients use for the model (default: the directory's name)"
    parser.add_argument("--served-model-name", default=None, metavar="NAME", help=name_help)
    if shapes:
        shape_help = "a real architecture with random weights, nothing downloaded (worker.shape)"
        parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help=shape_help)


def model_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides the model flags stand for (empty when none was given)."""
    overrides = []
    if args.model is not None:
        overrides.append(f"worker.model={Path(args.model).expanduser()}")
    if args.served_model_name is not None:
        overrides.append(f"worker.served_model_name={args.served_model_name}")
    if getattr(args, "shape", None) is not None:
        overrides.append(f"worker.shape={args.shape}")
    return overrides


def with_router_defaults(config: Config) -> Config:
    """A checkpoint's name and tokenizer as the router's, where the router's are left at their defaults.

    ``router.model_name`` becomes the served name (what completions report)
    and ``router.tokenizer`` the directory (its tokenizer, special tokens and
    chat template), so prompts are tokenized as the model was trained.
    """
    if not config.worker.model:
        return config
    router, defaults = config.router, RouterConfig()
    changes: dict[str, str] = {}
    if router.model_name == defaults.model_name:
        changes["model_name"] = served_name(config.worker)
    if router.tokenizer == defaults.tokenizer and (Path(config.worker.model) / "tokenizer.json").is_file():
        changes["tokenizer"] = config.worker.model
    return msgspec.structs.replace(config, router=msgspec.structs.replace(router, **changes))
