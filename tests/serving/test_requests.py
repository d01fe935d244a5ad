"""A request's state: the tokens it feeds, and its next token once a step completes them."""

from __future__ import annotations

import torch

from hf_paged_cache.serving.requests import GenerationOutput, Request


class _Greedy:
    """Settings whose next token is the argmax, or that fail when told to."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def next_token(self, logits, tokens):
        if self.error is not None:
            raise self.error
        return int(logits.argmax())


def test_a_request_feeds_its_prompt_then_each_generated_token():
    request = Request(GenerationOutput(3, [5, 6, 7]), _Greedy())
    assert request.request_id == 3 and request.pending == 3 and request.tokens == [5, 6, 7]
    request.fed = 3
    request.output.generated_tokens.append(9)
    assert request.tokens == [5, 6, 7, 9] and request.pending == 1


def test_the_next_token_comes_once_the_step_completes_the_pending_tokens_and_errors_are_returned():
    logits = torch.tensor([0.0, 2.0, 1.0])
    request = Request(GenerationOutput(0, [5, 6, 7]), _Greedy())
    assert request.next_token(2, logits) is None and request.next_token(3, logits) == 1
    failing = Request(GenerationOutput(1, [5]), _Greedy(ValueError("bad logits")))
    error = failing.next_token(1, logits)
    assert isinstance(error, ValueError) and str(error) == "bad logits"
