"""Hugging Face checkpoints in the worker's decoder: logits equal transformers', and what is (not) accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstore.deploy.config import config_from_dict
from kvstore.errors import ConfigError
from kvstore.workers.attention import SequenceSlice, build_metadata
from kvstore.workers.config import WorkerConfig, cache_identity
from kvstore.workers.hf_config import UnsupportedModelError, spec_from_hf_config
from kvstore.workers.model_runner import ModelRunner
from kvstore.workers.model_source import describe_model
from kvstore.workers.request_table import sampling_defaults
from kvstore.workers.sampler import SamplingDefaults
from tests.checkpoints import TinyCheckpoint, reference_model, write_checkpoint

CPU = torch.device("cpu")
BLOCK = 16
ARCHITECTURES = ["llama_checkpoint", "llama3_checkpoint", "qwen2_checkpoint", "mistral_checkpoint"]


def runner_for(path: Path, **worker: object) -> ModelRunner:
    config = WorkerConfig(model=str(path), device="cpu", **worker)  # type: ignore[arg-type]
    return ModelRunner(config, num_blocks=16, block_size=BLOCK, device=CPU)


@torch.inference_mode()
def step_logits(runner: ModelRunner, slices: list[SequenceSlice]) -> torch.Tensor:
    meta = build_metadata(slices, BLOCK, CPU)
    token_ids = torch.tensor([t for s in slices for t in s.token_ids])
    return runner.model(token_ids, meta, runner.kv_pool)


def chunked_logits(runner: ModelRunner, prompt: list[int], chunks: list[int], table: list[int]) -> torch.Tensor:
    """The last logits of each chunk, prefilled in order into the pool through ``table``."""
    rows, start = [], 0
    for n in chunks:
        rows.append(step_logits(runner, [SequenceSlice(prompt[start : start + n], start, table)])[0])
        start += n
    return torch.stack(rows)


@pytest.mark.parametrize("fixture", ARCHITECTURES)
def test_prefill_and_decode_logits_equal_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    checkpoint: TinyCheckpoint = request.getfixturevalue(fixture)
    reference = reference_model(checkpoint)
    prompt = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0]
    runner = runner_for(checkpoint.path)
    assert runner.served.dtype == "float32" and runner.served.spec.architecture == checkpoint.architecture
    # A 33-token prefill (chunked 20 + 13, crossing a block edge), then 37 single-token decode steps.
    chunks = [20, 13] + [1] * 37
    got = chunked_logits(runner, prompt, chunks, [9, 2, 14, 5, 11])
    ends = torch.tensor(chunks).cumsum(0) - 1
    torch.testing.assert_close(got, want[ends], atol=1e-4, rtol=0)
    # The same prompt prefilled whole, batched in one step with another sequence's decode.
    whole = step_logits(
        runner, [SequenceSlice(prompt, 0, [0, 1, 3, 4, 6]), SequenceSlice(prompt[33:34], 33, [9, 2, 14])]
    )
    torch.testing.assert_close(whole, want[[69, 33]], atol=1e-4, rtol=0)


def test_sliding_windows_reach_transformers_per_layer(tmp_path: Path) -> None:
    """Qwen2 with sliding windows on from layer 1 (``max_window_layers``): layer 0 full, layer 1 windowed."""
    config = {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}
    checkpoint = write_checkpoint(tmp_path, "Qwen2ForCausalLM", config, seed=5, chatml=True)
    runner = runner_for(tmp_path)
    assert runner.served.spec.sliding_windows == (None, 6)
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        want = reference_model(checkpoint)(torch.tensor([prompt])).logits[0]
    got = chunked_logits(runner, prompt, [25] + [1] * 15, [3, 1, 0])
    torch.testing.assert_close(got, want[24:], atol=1e-4, rtol=0)


def test_a_half_precision_checkpoint_runs_in_float32_on_the_cpu(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path, "LlamaForCausalLM", {}, seed=6, dtype=torch.float16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"
    runner = runner_for(tmp_path)
    assert runner.served.dtype == "float32" and runner.kv_pool.dtype == torch.float32
    prompt = list(range(5, 45))
    with torch.no_grad():  # every fp16 weight is exact in fp32: the fp32 reference is the same model
        want = reference_model(checkpoint, torch.float32)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(chunked_logits(runner, prompt, [40], [0, 1, 2])[0], want, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match=r"float16.*not supported on the CPU"):
        describe_model(WorkerConfig(model=str(tmp_path), dtype="float16"), CPU)
    assert describe_model(WorkerConfig(model=str(tmp_path), dtype="bfloat16"), CPU).dtype == "bfloat16"


def test_a_bfloat16_checkpoint_keeps_its_dtype_and_its_kv_is_half_the_size(
    llama_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    copy = shutil.copytree(llama_checkpoint.path, tmp_path / "bf16")
    weights = load_file(copy / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, copy / "model.safetensors")
    config = json.loads((copy / "config.json").read_text())
    del config["dtype"]  # the dtype then comes from the safetensors header
    (copy / "config.json").write_text(json.dumps(config))
    bf16 = describe_model(WorkerConfig(model=str(copy)), CPU)
    fp32 = describe_model(WorkerConfig(model=str(llama_checkpoint.path)), CPU)
    assert bf16.dtype == "bfloat16" and fp32.dtype == "float32"
    assert bf16.kv_layout(BLOCK).bytes_per_block * 2 == fp32.kv_layout(BLOCK).bytes_per_block
    runner = runner_for(copy)
    assert runner.kv_pool.dtype == torch.bfloat16 and runner.model.embed.weight.dtype == torch.bfloat16
    logits = chunked_logits(runner, list(range(1, 30)), [29], [0, 1])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_served_name_geometry_and_identity_come_from_the_checkpoint(
    llama_checkpoint: TinyCheckpoint, qwen2_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    def config(path: Path, **worker: object) -> object:
        return config_from_dict({"cache": {"block_size": BLOCK}, "worker": {"model": str(path), **worker}})

    llama = describe_model(WorkerConfig(model=str(llama_checkpoint.path)), CPU)
    assert llama.name == llama_checkpoint.path.name
    assert llama.eos_token_ids == llama_checkpoint.eos_token_ids
    assert llama.generation.temperature == 0.6 and llama.generation.top_p == 0.9
    assert llama.max_context == 512  # max_position_embeddings caps worker.max_context (2048)
    named = describe_model(WorkerConfig(model=str(llama_checkpoint.path), served_model_name="tiny"), CPU)
    assert named.name == "tiny" and named.weights_id == llama.weights_id  # the name is not the weights

    identity = cache_identity(config(llama_checkpoint.path))  # type: ignore[arg-type]
    layout = identity.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (2, 2, 16, "float32")
    assert identity.block_bytes == 2 * 2 * BLOCK * 2 * 16 * 4
    assert identity.model == llama.weights_id and identity.model.startswith("LlamaForCausalLM@")
    qwen = cache_identity(config(qwen2_checkpoint.path))  # type: ignore[arg-type]
    assert qwen.layout == layout and qwen.digest() != identity.digest()  # same geometry, other weights
    toy = cache_identity(config_from_dict({"cache": {"block_size": BLOCK}}))
    assert toy.digest() != identity.digest()

    moved = shutil.copytree(llama_checkpoint.path, tmp_path / "moved")
    assert cache_identity(config(moved)).digest() == identity.digest()  # type: ignore[arg-type]
    weights = load_file(moved / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0  # a "fine-tune" of one tensor
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    assert cache_identity(config(moved)).digest() != identity.digest()  # type: ignore[arg-type]


def test_both_rope_spellings_give_one_spec(llama3_checkpoint: TinyCheckpoint) -> None:
    old = json.loads((llama3_checkpoint.path / "config.json").read_text())
    assert "rope_scaling" in old and "rope_parameters" not in old
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**old["rope_scaling"], "rope_theta": old["rope_theta"]}
    spec = spec_from_hf_config(old)
    assert spec == spec_from_hf_config(new)
    assert (
        spec.rope.type == "llama3" and spec.rope.theta == 500000.0 and spec.rope.original_max_position_embeddings == 64
    )
    legacy = {**old, "rope_scaling": {"type": "linear", "factor": 2.0}}  # the pre-rope_type key
    assert spec_from_hf_config(legacy).rope.type == "linear"


def test_unsupported_models_are_rejected_naming_what_is_supported(
    llama_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    base = json.loads((llama_checkpoint.path / "config.json").read_text())
    cases = [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"),
        ({"hidden_act": "gelu"}, "only 'silu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ]
    for change, message in cases:
        with pytest.raises(UnsupportedModelError, match=message):
            spec_from_hf_config({**base, **change})

    broken = shutil.copytree(llama_checkpoint.path, tmp_path / "broken")
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"does not use: \['model.layers.0.mlp.extra.weight'\]"):
        runner_for(broken)
    del weights["model.layers.0.mlp.extra.weight"], weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lacks tensors.*layers.1.self_attn.k_proj.weight"):
        runner_for(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no model.safetensors nor model.safetensors.index.json"):
        runner_for(broken)
    with pytest.raises(ConfigError, match="not a directory"):
        describe_model(WorkerConfig(model=str(tmp_path / "absent")), CPU)
    with pytest.raises(ConfigError, match="exclude each other"):
        config_from_dict({"worker": {"model": str(broken), "shape": "qwen2.5-0.5b"}})


def test_builtin_shapes_are_real_geometries_with_seeded_weights() -> None:
    qwen = describe_model(WorkerConfig(shape="qwen2.5-0.5b", max_context=4096), CPU)
    assert qwen.name == "qwen2.5-0.5b" and qwen.dtype == "bfloat16" and qwen.max_context == 4096
    assert qwen.kv_layout(16).bytes_per_block == 192 * 1024  # 24 layers x 2 KV heads x 64 x 16 tokens x bf16 x K,V
    assert qwen.spec.qkv_bias and qwen.spec.tie_word_embeddings and qwen.seed == 0
    llama = describe_model(WorkerConfig(shape="llama-3.1-8b", dtype="float32"), CPU)
    assert llama.spec.rope.type == "llama3" and llama.kv_layout(16).bytes_per_block == 4 << 20
    with pytest.raises(ConfigError, match=r"not a built-in shape; choose one of qwen2.5-0.5b"):
        describe_model(WorkerConfig(shape="gpt-5"), CPU)
    assert msgspec.structs.replace(qwen, name="x").weights_id == "shape:qwen2.5-0.5b(seed=0)"


@pytest.mark.gpu
def test_a_checkpoint_loads_onto_the_gpu_in_bfloat16_close_to_transformers(llama_checkpoint: TinyCheckpoint) -> None:
    cuda = torch.device("cuda", 0)
    config = WorkerConfig(model=str(llama_checkpoint.path), device="cuda", dtype="bfloat16")
    runner = ModelRunner(config, num_blocks=16, block_size=BLOCK, device=cuda)
    assert runner.model.embed.weight.device.type == "cuda" and runner.kv_pool.kv.dtype == torch.bfloat16
    prompt = list(range(3, 60))
    reference = reference_model(llama_checkpoint, torch.bfloat16).to(cuda)
    with torch.no_grad():
        want = reference(torch.tensor([prompt], device=cuda)).logits[0, -1].float()
    meta = build_metadata([SequenceSlice(prompt, 0, [0, 1, 2, 3])], BLOCK, cuda)
    with torch.inference_mode():
        got = runner.model(torch.tensor(prompt, device=cuda), meta, runner.kv_pool)[0]
    assert got.argmax() == want.argmax()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_every_sampling_default_vllm_reads_from_generation_config_applies(
    llama_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """vLLM takes temperature, top_p, top_k, min_p and repetition_penalty from generation_config.json for what a
    request leaves unset, and max_new_tokens as a cap; the last three were once dropped."""
    copy = shutil.copytree(llama_checkpoint.path, tmp_path / "penalised")
    path = copy / "generation_config.json"
    generation = json.loads(path.read_text())
    path.write_text(
        json.dumps({**generation, "repetition_penalty": 1.05, "min_p": 0.1, "top_k": 20, "max_new_tokens": 7})
    )
    served = describe_model(WorkerConfig(model=str(copy)), CPU)
    defaults = sampling_defaults(served)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.05)
    assert served.generation.max_new_tokens == 7  # what ModelInfo hands the fronts, which cap max_tokens with it
    plain = sampling_defaults(describe_model(WorkerConfig(model=str(llama_checkpoint.path)), CPU))
    assert plain == SamplingDefaults(temperature=0.6, top_p=0.9)  # the rest: vLLM's neutral defaults


@pytest.mark.parametrize(
    ("arch", "config", "windows"),
    [
        ("MistralForCausalLM", {}, (4096, 4096)),  # the key left out: transformers' default window
        ("MistralForCausalLM", {"sliding_window": None}, ()),  # an explicit null: no window (Mistral v0.2 on)
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}, (None, 4096)),
        ("Qwen2ForCausalLM", {}, ()),  # windows off
    ],
    ids=["mistral-absent", "mistral-null", "qwen2-on-absent", "qwen2-off"],
)
def test_a_sliding_window_left_out_of_config_json_is_transformers_default(
    tmp_path: Path, arch: str, config: dict[str, object], windows: tuple[int | None, ...]
) -> None:
    """config.json without ``sliding_window``: transformers' config class fills in 4096, so must we (before:
    full attention, and outputs that part from transformers' past position 4096)."""
    import transformers

    write_checkpoint(tmp_path, arch, {}, seed=7, chatml=arch.startswith("Qwen2"))
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("sliding_window", None)
    written.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps({**written, **config}))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    kinds = getattr(theirs, "layer_types", None) or ["sliding_attention"] * len(windows)  # Mistral: every layer
    expected = tuple(theirs.sliding_window if kind == "sliding_attention" else None for kind in kinds)
    assert runner_for(tmp_path).served.spec.sliding_windows == windows
    if windows:
        assert expected == windows  # the same layers, the same window, as transformers'
    else:
        assert theirs.sliding_window is None or not getattr(theirs, "use_sliding_window", True)
