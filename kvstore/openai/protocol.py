"""The router's HTTP request schema and its validation (OpenAI completions, plus ours).

Bodies are decoded with msgspec rather than pydantic so every rejection
names the offending field exactly; every failure is an :class:`ApiError`
that the app renders as an OpenAI-style error body.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "service_unavailable")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/completions`` (and ``POST /route``): the OpenAI fields plus vLLM's ``cache_salt``."""

    prompt: str | list[Any]  # text or token ids; batches (lists of prompts) are rejected by name
    model: str | None = None
    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    echo: bool = False
    logprobs: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    suffix: str | None = None
    user: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


_SAMPLING_FIELDS = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed")


class ModelLimits(NamedTuple):
    vocab_size: int | None  # None: unknown here, the replica checks
    max_context: int | None


class ParsedPrompt(NamedTuple):
    token_ids: list[int]
    max_tokens: int
    cache_salt: str | None
    lora_name: str | None
    model: str | None
    sampling: dict[str, Any]  # passed through to replicas that sample


_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_request(body: bytes) -> CompletionRequest:
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        text, sep, where = str(exc).rpartition(" - at `")
        if not sep:
            text, where = str(exc), ""
        param = where.rstrip("`").removeprefix("$").lstrip(".") or None
        if text.startswith("Object contains unknown field"):
            return _raise(400, f"{text}; allowed fields: {', '.join(CompletionRequest.__struct_fields__)}", param)
        if param is None and text.startswith("Expected `object`"):
            text = f"request body must be a JSON object: {text}"
        return _raise(400, text, param)
    except msgspec.DecodeError as exc:
        return _raise(400, f"request body is not valid JSON: {exc}", None)
    except UnicodeDecodeError as exc:  # msgspec raises it, not DecodeError, for bad UTF-8 inside a string
        return _raise(400, f"request body is not valid JSON: invalid UTF-8 in a string ({exc.reason})", None)
    except RecursionError:  # arrays/objects nested deeper than msgspec's decoder allows
        return _raise(400, "request body is not valid JSON: nested too deeply", None)


def _raise(status: int, message: str, param: str | None) -> Any:
    raise ApiError(status, message, param=param)


def validate(req: CompletionRequest, token_ids: list[int], limits: ModelLimits) -> ParsedPrompt:
    """Check a decoded request against the model; ``token_ids`` is the tokenised prompt."""
    if req.stream:
        raise ApiError(400, "stream=true is not supported; send stream=false", param="stream")
    if req.n != 1 or (req.best_of is not None and req.best_of != 1):
        raise ApiError(400, "only n=1 (and best_of=1) is supported", param="n")
    if req.echo:
        raise ApiError(400, "echo=true is not supported", param="echo")
    if req.logprobs is not None:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
    if not token_ids:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    upper = limits.vocab_size
    bad = next((t for t in token_ids if t < 0 or (upper is not None and t >= upper)), None)
    if bad is not None:
        bound = "" if upper is None else f", {upper})"
        raise ApiError(400, f"token id {bad} is out of range [0{bound or ', ...)'}", param="prompt")
    total = len(token_ids) + req.max_tokens
    if limits.max_context is not None and total > limits.max_context:
        raise ApiError(
            400,
            f"prompt ({len(token_ids)} tokens) + max_tokens ({req.max_tokens}) = {total} exceeds the model's "
            f"context of {limits.max_context} tokens",
            param="prompt",
        )
    sampling = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
    return ParsedPrompt(token_ids, req.max_tokens, req.cache_salt, req.lora_name, req.model, sampling)


def prompt_token_ids(req: CompletionRequest, encode: Any) -> list[int]:
    """Tokenise the prompt (text via ``encode``; token ids as given)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return list(encode(prompt))
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(type(p) is int for p in prompt):
        return list(prompt)
    if all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of integer token ids", param="prompt")
