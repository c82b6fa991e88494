"""The model flags of ``kvstore serve``/``worker``/``bench ttft``: overrides, and the router's defaults."""

from __future__ import annotations

from kvstore.cli import build_parser
from kvstore.deploy.config import load_config
from kvstore.deploy.model_args import model_overrides, with_router_defaults
from tests.checkpoints import TinyCheckpoint


def test_model_flags_are_worker_overrides_that_set_wins_over(llama_checkpoint: TinyCheckpoint) -> None:
    path = str(llama_checkpoint.path)
    for command in (["serve"], ["worker"], ["bench", "ttft"]):
        args = build_parser().parse_args([*command, "--model", path, "--served-model-name", "tiny"])
        assert model_overrides(args) == [f"worker.model={path}", "worker.served_model_name=tiny"]
    args = build_parser().parse_args(["bench", "ttft", "--shape", "qwen2.5-0.5b"])
    assert model_overrides(args) == ["worker.shape=qwen2.5-0.5b"]
    assert model_overrides(build_parser().parse_args(["serve"])) == []
    args = build_parser().parse_args(["serve", "--model", path, "--set", "worker.served_model_name=other"])
    config = load_config(overrides=[*model_overrides(args), *args.set])
    assert config.worker.model == path and config.worker.served_model_name == "other"


def test_a_checkpoint_names_the_router_model_and_its_tokenizer(llama_checkpoint: TinyCheckpoint) -> None:
    path = llama_checkpoint.path
    config = with_router_defaults(load_config(overrides=[f"worker.model={path}"]))
    assert config.router.model_name == path.name and config.router.tokenizer == str(path)
    named = with_router_defaults(load_config(overrides=[f"worker.model={path}", "worker.served_model_name=tiny"]))
    assert named.router.model_name == "tiny"
    kept = with_router_defaults(load_config(overrides=[f"worker.model={path}", "router.model_name=mine"]))
    assert kept.router.model_name == "mine"  # what the user set stays
    toy = load_config()
    assert with_router_defaults(toy) == toy
