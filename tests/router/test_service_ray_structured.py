"""Structured output, forced tool calls and a tool-call parser's calls through the router, over a Ray worker
serving a checkpoint, as ``kvstore serve --model`` runs them: the router compiles and checks the grammar, the worker
actor builds the matcher off its event loop, the router's parser reads the calls, and the answers come back through
the official ``openai`` client."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import pydantic
import pytest
import ray

from kvstore.deploy.config import config_from_dict
from kvstore.deploy.launcher import build_service, place_workers
from kvstore.deploy.model_args import with_router_defaults
from kvstore.router.app import create_app
from tests import openai_conformance as check
from tests.checkpoints import TinyCheckpoint
from tests.http_servers import ServerThread

ARGUMENTS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGUMENTS}}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Verdict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    label: Literal["hit", "miss"]
    blocks: int = pydantic.Field(ge=0, le=99)


@pytest.mark.ray
def test_structured_output_and_forced_calls_through_the_router(
    ray_session: Any, qwen2_checkpoint: TinyCheckpoint
) -> None:
    config = with_router_defaults(
        config_from_dict(
            {
                "pool": {"num_blocks": 128},
                "worker": {"device": "cpu", "model": str(qwen2_checkpoint.path)},
                "router": {"health_interval_s": 0.2, "tool_call_parser": "qwen3_coder"},
            }
        )
    )
    workers = place_workers(config, 1, start_index=300)
    service = build_service(config, workers)
    server = ServerThread(create_app(service)).start()
    try:
        client = check.client(server.url)
        model = config.router.model_name
        messages = [{"role": "user", "content": "Was it a hit?"}]
        for seed in range(2):
            parsed = client.chat.completions.parse(
                model=model, messages=messages, response_format=Verdict, max_tokens=60, temperature=1.0,  # type: ignore[arg-type]
                seed=seed, extra_body=COMPACT,
            )  # fmt: skip
            assert isinstance(parsed.choices[0].message.parsed, Verdict), parsed
        forced = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,  # type: ignore[arg-type]
            max_tokens=80, temperature=1.0, seed=3, extra_body=COMPACT,
        )  # fmt: skip
        choice = forced.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), ARGUMENTS)  # type: ignore[union-attr]
        # tool_choice "auto" read by the router's qwen3_coder parser: the regex holds the answer to one call, which
        # comes back as tool_calls -- plain, and streamed through the openai client's accumulator alike.
        head, middle = "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n", "\n</parameter>\n"
        tail = "\n</parameter>\n</function>\n</tool_call>"
        spelled = (
            f"{re.escape(head)}[a-z]{{1,6}}{re.escape(middle + '<parameter=unit>' + chr(10))}(c|f){re.escape(tail)}"
        )
        asked = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, "seed": 5,
                 "extra_body": {"structured_outputs": {"regex": spelled}}}  # fmt: skip
        plain = client.chat.completions.create(**asked).choices[0]
        assert plain.finish_reason == "tool_calls" and plain.message.content == "Let me see.\n", plain
        (call,) = plain.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), ARGUMENTS)  # type: ignore[union-attr]
        with client.chat.completions.stream(**asked) as events:
            final = events.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls" and final.message.content == "Let me see.\n", final
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == [
            (call.function.name, call.function.arguments)]  # type: ignore[union-attr]  # fmt: skip
        streamed = client.completions.create(
            model=model, prompt="Port:", max_tokens=10, temperature=1.0, seed=1, stream=True,
            extra_body={"structured_outputs": {"regex": "[1-9][0-9]{3}"}},
        )  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        assert len(text) == 4 and text.isdigit() and text[0] != "0", text

        bad = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model, "prompt": "x", "structured_outputs": {"regex": "[a-"}},
            timeout=30,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs.regex", bad.text
        wide = "start: " + " | ".join(f'"t{i}"' for i in range(3000))  # passes the check, fails on the worker
        failed = httpx.post(
            f"{server.url}/v1/completions", json={"model": model, "prompt": "x", "guided_grammar": wide}, timeout=30
        )
        assert failed.status_code == 400 and "mid-answer" in failed.json()["error"]["message"], failed.text
        assert client.completions.create(model=model, prompt="still", max_tokens=2).choices  # still serving
    finally:
        server.stop()
        for w in workers:
            ray.kill(w.handle, no_restart=True)
