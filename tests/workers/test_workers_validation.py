"""Bad requests raise InvalidRequestError with a clear message before queuing; the worker keeps serving."""

from __future__ import annotations

from typing import Any

import pytest
from workers_testlib import WorkerFactory

from kvstore.errors import InvalidRequestError
from kvstore.worker_api import GenerateRequest, SamplingParams

BAD_REQUESTS: list[tuple[Any, str]] = [
    (GenerateRequest([], 4), "must not be empty"),
    (GenerateRequest([1, 512, 3], 4), r"token_ids\[1\] = 512 is out of the vocabulary range \[0, 512\)"),
    (GenerateRequest([1, -1], 4), r"token_ids\[1\] = -1 is out of the vocabulary range"),
    (GenerateRequest([1, 2.0], 4), r"token_ids\[1\] must be an int, got float"),  # type: ignore[list-item]
    (GenerateRequest([1, "2"], 4), r"token_ids\[1\] must be an int, got str"),  # type: ignore[list-item]
    (GenerateRequest([True], 4), r"token_ids\[0\] must be an int, got bool"),
    (GenerateRequest("hello", 4), "token_ids must be a list of ints, got str"),  # type: ignore[arg-type]
    (GenerateRequest([1], 0), "max_tokens must be >= 1, got 0"),
    (GenerateRequest([1], -3), "max_tokens must be >= 1, got -3"),
    (GenerateRequest([1], 2.5), "max_tokens must be an int"),  # type: ignore[arg-type]
    (GenerateRequest([1] * 2000, 49), r"prompt \(2000 tokens\) \+ max_tokens \(49\) = 2049 exceeds the model's"),
    (GenerateRequest([1], 1, request_id=7), "request_id must be a string"),  # type: ignore[arg-type]
    ({"token_ids": [1], "max_tokens": 1}, "expected a GenerateRequest, got dict"),
    (GenerateRequest([1], 2, sampling=SamplingParams(allowed_token_ids=(3, 512))), "must be in the vocabulary"),
    (GenerateRequest([1], 2, sampling=SamplingParams(allowed_token_ids=())), "allowed_token_ids must not be empty"),
    (GenerateRequest([1], 2, sampling=SamplingParams(bad_words_token_ids=((5, 600),))), "must be in the vocabulary"),
    (GenerateRequest([1], 2, sampling=SamplingParams(bad_words_token_ids=((),))), r"1\.\.4096 ids each"),
    (GenerateRequest([1], 2, sampling=SamplingParams(bad_words_token_ids=((1,),) * 129)), "at most 128 sequences"),
]


@pytest.mark.parametrize(("request_", "message"), BAD_REQUESTS, ids=[m[:30] for _, m in BAD_REQUESTS])
def test_bad_input_is_rejected_clearly_and_the_worker_still_serves(
    make_worker: WorkerFactory, request_: Any, message: str
) -> None:
    worker = make_worker()
    with pytest.raises(InvalidRequestError, match=message):
        worker.generate(request_)
    with pytest.raises(InvalidRequestError, match=message):
        worker.submit(request_)
    assert worker.load().waiting == 0
    assert len(worker.generate(GenerateRequest([1, 2, 3], 2)).output_token_ids) == 2
    worker.check_invariants()
    assert 'kvstore_requests_total{outcome="rejected",replica="w0"} 2.0' in worker.metrics_text().decode()


def test_a_request_larger_than_the_pool_is_rejected_not_left_waiting_forever(make_worker: WorkerFactory) -> None:
    worker = make_worker(num_blocks=8, watermark=0.25)  # 2 blocks kept free at admission: 6 per request
    with pytest.raises(InvalidRequestError, match="needs 7 KV blocks but this worker can give one request at most 6"):
        worker.generate(GenerateRequest([1] * 90, 8))
    assert len(worker.generate(GenerateRequest([1] * 90, 7)).output_token_ids) == 7  # 96 tokens of KV: 6 blocks
