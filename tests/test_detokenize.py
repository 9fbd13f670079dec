"""Incremental detokenisation: the text only grows, equals a full decode, and stops cut exactly."""

import random

import pytest

from specray.engine.params import SamplingParams
from specray.engine.request import Request
from specray.policies.registry import PlainOptions


@pytest.fixture(scope="module")
def tokenizer(demo_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_pair.tokenizer)


@pytest.mark.slow
def test_incremental_text_grows_and_equals_a_full_decode(tokenizer):
    rng = random.Random(0)
    text = "déjà vu — naïve café ✓ 東京 🎉\n" * 3 + "def f(x):\n    return x ** 2\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for trial in range(20):
        req = Request("r", [1], SamplingParams(max_tokens=len(ids) + 1), PlainOptions(), frozenset())
        seen, i = "", 0
        while i < len(ids):
            n = rng.randint(1, 5)  # steps accept 1-5 tokens
            req.append(ids[i : i + n], capacity=10**6, tokenizer=tokenizer)
            assert req.text.startswith(seen) and "\ufffd" not in req.text
            seen, i = req.text, i + n
        assert req.text == tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.slow
def test_stop_strings_cut_where_plain_decoding_would(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma delta", add_special_tokens=False)
    for chunk in (1, 2, 7):
        req = Request("r", [1], SamplingParams(max_tokens=100, stop=["STOP"]), PlainOptions(), frozenset())
        for i in range(0, len(ids), chunk):
            req.append(ids[i : i + chunk], capacity=10**6, tokenizer=tokenizer)
            if req.finished:
                break
        assert req.finish_reason == "stop" and req.text == "alpha beta "
        assert tokenizer.decode(req.output_ids).startswith("alpha beta") and "STOP" in tokenizer.decode(req.output_ids)
