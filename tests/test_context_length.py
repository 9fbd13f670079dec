"""Requests that cannot fit the context: the typed error, and what max_tokens a request gets."""

import pickle

import pytest

from specray.engine.params import SamplingParams
from specray.engine.intake import ContextLengthError, RequestMaker, check_context_length
from specray.policies.registry import Limits
from specray.protocol import openai as P

LIMITS = Limits(capacity=32, vocab_size=64, methods={"none": {}})


def test_strict_scheduler_refuses_max_tokens_beyond_the_context():
    intake = RequestMaker(LIMITS, strict_context=True)
    with pytest.raises(ContextLengthError) as caught:
        intake.make(list(range(20)), SamplingParams(max_tokens=13))
    err = caught.value
    assert isinstance(err, ValueError)  # the ingress and callers that catch ValueError keep working
    assert (err.prompt_tokens, err.max_tokens, err.context) == (20, 13, 32)
    assert "maximum context length is 32 tokens" in str(err) and "33 tokens (20 in the prompt, 13 in" in str(err)
    assert intake.make(list(range(20)), SamplingParams(max_tokens=12)).prompt_ids == list(range(20))


def test_lenient_scheduler_leaves_the_context_to_end_the_request():
    """The in-process engine's contract (tests/test_engine.py): such a request finishes with
    'length' when the context is full. A prompt that leaves no room is refused either way."""
    intake = RequestMaker(LIMITS)
    assert intake.make(list(range(20)), SamplingParams(max_tokens=1000)).sampling.max_tokens == 1000
    for strict in (False, True):
        with pytest.raises(ContextLengthError, match="prompt has 32 tokens; the model's context is 32"):
            RequestMaker(LIMITS, strict_context=strict).make(list(range(32)), SamplingParams(max_tokens=1))


def test_context_length_error_crosses_processes_intact():
    """Ray pickles it on the way to the ingress; a custom __init__ must not break that (500)."""
    err = pickle.loads(pickle.dumps(ContextLengthError(5, 1_000_000_000, 256)))
    assert isinstance(err, ContextLengthError) and err.max_tokens == 1_000_000_000 and "1000000005" in str(err)


def test_check_context_length_boundaries():
    check_context_length(31, None, 32)
    check_context_length(20, 12, 32)
    for prompt, max_tokens in ((32, None), (20, 13), (31, 2)):
        with pytest.raises(ContextLengthError):
            check_context_length(prompt, max_tokens, 32)


@pytest.mark.parametrize("chat", [False, True])
def test_max_tokens_a_request_gets(chat):
    def request(**fields):
        if chat:
            return P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **fields)
        return P.CompletionRequest(model="m", prompt=[1], **fields)

    # Without a number: chat runs to the context, a completion gets the default (cut to the room).
    assert P.resolve_max_tokens(request(), 10, 32, 16, chat) == (22 if chat else 16)
    assert P.resolve_max_tokens(request(), 30, 32, 16, chat) == 2
    assert P.resolve_max_tokens(request(max_tokens=22), 10, 32, 16, chat) == 22
    with pytest.raises(ContextLengthError, match="33 tokens"):
        P.resolve_max_tokens(request(max_tokens=23), 10, 32, 16, chat)
    if chat:
        with pytest.raises(ContextLengthError, match="10 in the prompt, 40 in the completion"):
            P.resolve_max_tokens(request(max_completion_tokens=40), 10, 32, 16, chat)
