"""Config: defaults < TOML file < KVSTORE_SECTION__FIELD env < --set overrides, validated with clear errors."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvstore.config import CacheConfig, EventsConfig, PoolConfig
from kvstore.deploy.config import Config, config_from_dict, load_config
from kvstore.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.cache == CacheConfig(
        block_size=16, hash_algo="sha256_cbor", hash_seed="kvstore", enable_prefix_caching=True
    )
    assert config.pool == PoolConfig(num_blocks=1024, watermark=0.01)
    assert config.events.endpoint == "tcp://127.0.0.1:*"
    assert config.events.replay_endpoint == "tcp://127.0.0.1:*"
    assert config.events.bind is True and config.events.buffer_batches == 10_000
    assert config.events.buffer_bytes == 64 * 2**20
    assert config.events.include_token_ids is True and config.events.curve_allowed_client_keys == ()
    with pytest.raises(AttributeError):
        config.cache.block_size = 8  # type: ignore[misc]  # frozen: never mutated at run time


def test_toml_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[cache]\nblock_size = 32\nhash_algo = "xxh3_128"\nhash_seed = "vllm-none-hash"\n'
        '[pool]\nnum_blocks = 64\n[events]\ntopic = "kv"\nbuffer_batches = 8\n',
    )
    config = load_config(path, env={})
    assert config.cache == CacheConfig(block_size=32, hash_algo="xxh3_128", hash_seed="vllm-none-hash")
    assert config.pool == PoolConfig(num_blocks=64)  # watermark keeps its default
    assert config.events == EventsConfig(topic="kv", buffer_batches=8)
    assert load_config(str(path), env={}) == config


def test_environment_overrides() -> None:
    env = {
        "KVSTORE_CACHE__BLOCK_SIZE": "64",
        "KVSTORE_POOL__WATERMARK": "0.5",
        "KVSTORE_EVENTS__ENABLED": "false",
        "KVSTORE_EVENTS__TOPIC": "kv-events",  # not TOML: taken as a plain string
        "KVSTORE_LOG_LEVEL": "debug",  # no section separator: not ours
        "OTHER_CACHE__BLOCK_SIZE": "8",  # other prefix: ignored
    }
    config = load_config(env=env)
    assert config.cache.block_size == 64
    assert config.pool.watermark == 0.5
    assert config.events.enabled is False
    assert config.events.topic == "kv-events"


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_POOL__NUM_BLOCKS", "77")
    assert load_config().pool.num_blocks == 77


def test_string_fields_take_numeric_looking_values_verbatim() -> None:
    # A vLLM fleet's seed is its PYTHONHASHSEED, e.g. "0": it must stay a string.
    assert load_config(env={"KVSTORE_CACHE__HASH_SEED": "12345"}).cache.hash_seed == "12345"
    assert load_config(env={}, overrides=["cache.hash_seed=0"]).cache.hash_seed == "0"
    assert load_config(env={}, overrides=['cache.hash_seed="0"']).cache.hash_seed == "0"
    assert load_config(env={}, overrides=["events.topic=true"]).events.topic == "true"


def test_optional_string_fields_take_the_text_as_written_too() -> None:
    """``str | None`` fields (a disk directory, a node name) are strings from the environment and ``--set``: a
    directory called 2024-01-01 is not a TOML date, nor one called 2024 an integer."""
    from kvstore.config import _parse_scalar

    assert _parse_scalar(Config, "2024-01-01", "tiers.disk_dir") == "2024-01-01"  # not datetime.date(2024, 1, 1)
    assert _parse_scalar(Config, "2024", "tiers.disk_dir") == "2024"
    assert _parse_scalar(Config, '"/quoted"', "tiers.disk_dir") == "/quoted"
    assert _parse_scalar(Config, "2024", "router.replicas[0].node") == "2024"
    assert _parse_scalar(Config, "2024", "pool.num_blocks") == 2024  # other fields still parse their TOML
    assert load_config(env={"KVSTORE_TIERS__DISK_DIR": "/data"}).tiers.disk_dir == "/data"


def test_an_environment_setting_with_one_underscore_is_an_error_not_ignored() -> None:
    with pytest.raises(ConfigError, match=r"KVSTORE_TIERS_DISK_DIR: .*two underscores .*KVSTORE_TIERS__"):
        load_config(env={"KVSTORE_TIERS_DISK_DIR": "/data"})
    load_config(env={"KVSTORE_LOG_LEVEL": "INFO", "KVSTORE_VENV": "/x"})  # not a section: not ours to judge


def test_set_overrides() -> None:
    config = load_config(env={}, overrides=["cache.block_size=32", "cache.hash_algo=xxh3_128", "events.bind=false"])
    assert config.cache.block_size == 32
    assert config.cache.hash_algo == "xxh3_128"
    assert config.events.bind is False
    config = load_config(env={}, overrides=[" cache.hash_algo = sha256_cbor "])
    assert config.cache.hash_algo == "sha256_cbor"


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "[cache]\nblock_size = 32\nhash_seed = 'from-file'\n[pool]\nnum_blocks = 10\n")
    env = {"KVSTORE_CACHE__BLOCK_SIZE": "48", "KVSTORE_POOL__NUM_BLOCKS": "20"}
    assert load_config(path, env={}).cache.block_size == 32  # file beats defaults
    config = load_config(path, env=env)
    assert config.cache.block_size == 48  # env beats file
    assert config.pool.num_blocks == 20
    assert config.cache.hash_seed == "from-file"  # untouched by env
    config = load_config(path, env=env, overrides=["cache.block_size=64"])
    assert config.cache.block_size == 64  # overrides beat env
    assert config.pool.num_blocks == 20
    assert config.cache.hash_algo == "sha256_cbor"  # default, set nowhere


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"overrides": ["cache.block_size=0"]}, r"cache\.block_size.*>= 1"),
        ({"overrides": ["cache.block_size=abc"]}, r"cache\.block_size.*int"),
        ({"overrides": ["pool.watermark=1.5"]}, r"pool\.watermark.*<= 1"),
        ({"env": {"KVSTORE_POOL__NUM_BLOCKS": "-1"}}, r"pool\.num_blocks"),
        ({"overrides": ["cache=1"]}, r"field cache\b"),
        ({"overrides": ["events.buffer_bytes=0"]}, r"events\.buffer_bytes.*>= 1"),
        ({"overrides": ["worker.offload_wait_s=0"]}, r"worker\.offload_wait_s.*> 0"),
        ({"overrides": ["worker.vocab_size=1"]}, r"field worker: vocab_size must be at least 256 for the built-in"),
        ({"env": {"KVSTORE_EVENTS__BUFFER_BYTES": "lots"}}, r"events\.buffer_bytes.*int"),
        ({"overrides": ['events.curve_allowed_client_keys=["' + "k" * 40 + '"]']}, r"needs CURVE on"),
        ({"overrides": ["events.endpoint=garbage"]}, r"field events: endpoint must be a ZeroMQ endpoint.*'garbage'"),
        ({"overrides": ['events.replay_endpoint="tcp://10.0.0.5"']}, r"replay_endpoint must be a ZeroMQ endpoint"),
        ({"overrides": ['events.endpoint="htp://x:1"']}, r"endpoint must be a ZeroMQ endpoint"),
        ({"overrides": ['events.endpoint="tcp://127.0.0.1:99999"']}, r"endpoint must be a ZeroMQ endpoint"),
        ({"overrides": ['events.endpoint="tcp://:5557"']}, r"endpoint must be a ZeroMQ endpoint"),
    ],
)
def test_errors_name_the_field(kwargs: dict, expected: str) -> None:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError, match=expected):
        load_config(**kwargs)


def test_hash_algo_error_lists_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=["cache.hash_algo=md5"])
    message = str(info.value)
    assert "cache.hash_algo" in message
    assert "sha256_cbor" in message and "xxh3_128" in message
    assert "md5" in message


def test_unknown_fields_are_rejected_naming_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=["cache.blocksize=8"])
    message = str(info.value)
    assert "blocksize" in message
    for known in ("block_size", "hash_algo", "hash_seed", "enable_prefix_caching"):
        assert known in message

    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "[caches]\nblock_size = 8\n"), env={})
    message = str(info.value)
    assert "caches" in message
    for section in ("cache", "pool", "events", "worker", "tiers", "router"):
        assert section in message

    with pytest.raises(ConfigError, match=r"bogus.*known fields: .*cache"):
        load_config(env={"KVSTORE_BOGUS__FIELD": "1"})


def test_missing_file_bad_toml_and_bad_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[cache\nblock_size = 1\n"), env={})
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path, env={})
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"\xff\xfe[router]\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0\)"):
        load_config(latin, env={})
    good = load_config(overrides=['events.endpoint="ipc:///tmp/kv-events"', 'events.replay_endpoint="tcp://*:5558"'])
    assert good.events.endpoint == "ipc:///tmp/kv-events"
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(env={}, overrides=["cache.block_size"])
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(env={}, overrides=["=3"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(env={}, overrides=["cache.block_size=4", "cache.block_size.x=1"])
    assert issubclass(ConfigError, ValueError)


def test_loaded_config_round_trips_through_msgspec() -> None:
    config = load_config(env={}, overrides=["cache.block_size=8"])
    assert msgspec.convert(msgspec.to_builtins(config), Config) == config


def test_an_external_replicas_event_endpoints_are_checked() -> None:
    replica = {"name": "r0", "url": "http://127.0.0.1:8000", "events": "10.0.0.5:5557"}
    with pytest.raises(ConfigError, match=r"router\.replicas\[0\]: events must be a ZeroMQ endpoint.*10\.0\.0\.5:5557"):
        config_from_dict({"router": {"replicas": [replica]}})
    with pytest.raises(ConfigError, match=r"replay must be a ZeroMQ endpoint"):
        config_from_dict({"router": {"replicas": [{**replica, "events": "tcp://10.0.0.5:5557", "replay": "x"}]}})


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:99999", "not a usable URL.*out of range"),
        ("http://127.0.0.1:abc", "not a usable URL"),
        ("http://", "names no host"),
        ("http://[::1", "not a usable URL"),
        ("http://127.0.0.1:0", "port 0"),
        ("ftp://127.0.0.1:8000", "must start with http:// or https://"),
    ],
)
def test_a_replica_url_that_cannot_be_reached_is_a_config_error(url: str, expected: str) -> None:
    from kvstore.deploy.router_cli import build_router

    replica = {"name": "r0", "url": url, "events": "tcp://127.0.0.1:5557"}
    with pytest.raises(ConfigError, match=r"router\.replicas\[r0\]\.url.*" + expected):
        build_router(config_from_dict({"router": {"replicas": [replica]}}))


def test_an_unknown_field_in_a_replica_lists_the_replicas_known_fields() -> None:
    replica = {"name": "r0", "url": "http://127.0.0.1:8000", "events": "tcp://127.0.0.1:5557", "evnets": "x"}
    expected = r"router\.replicas\[0\]: .*unknown field `evnets` \(known fields: name, url, events"
    with pytest.raises(ConfigError, match=expected):
        config_from_dict({"router": {"replicas": [replica]}})
