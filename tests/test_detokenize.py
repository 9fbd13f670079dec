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


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    """The serve tests' one-character-per-token tokenizer, with "Z" made a special token."""
    from transformers import AutoTokenizer

    from tests.conftest import save_char_tokenizer

    path = tmp_path_factory.mktemp("chars")
    save_char_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"eos_token": "Z"})
    return tok


def run(tok, text: str, chunk: int, **params) -> Request:
    """Append ``text``'s tokens ``chunk`` at a time (steps that accept several tokens) until a stop."""
    from tests.conftest import encode

    ids = encode(text)
    req = Request("r", [1], SamplingParams(max_tokens=100, **params), PlainOptions(), frozenset())
    for i in range(0, len(ids), chunk):
        req.append(ids[i : i + chunk], capacity=10**6, tokenizer=tok)
        if req.finished:
            break
    return req


@pytest.mark.parametrize("chunk", [1, 2, 7])
def test_stop_strings_kept_and_min_tokens(chars, chunk):
    """include_stop_str_in_output keeps the stop string (and the fewest tokens making it);
    with min_tokens a stop string counts only when a token past the first min_tokens ends it
    (vLLM's rule), wherever the steps' boundaries fall."""
    req = run(chars, "abcSTOPdefSTOPghi", chunk, stop=["STOP"], include_stop_str_in_output=True)
    assert (req.text, len(req.output_ids), req.finish_reason) == ("abcSTOP", 7, "stop")
    req = run(chars, "abcSTOPdefSTOPghi", chunk, stop=["STOP"], min_tokens=7)
    assert (req.text, len(req.output_ids)) == ("abcSTOPdef", 14)
    req = run(chars, "abcSTOPdefSTOPghi", chunk, stop=["STOP"], min_tokens=6)  # its last token is the 7th
    assert req.text == "abc"


def test_skip_special_tokens(chars):
    assert run(chars, "abZcd", 2).text == "abcd"
    assert run(chars, "abZcd", 2, skip_special_tokens=False).text == "abZcd"


def test_fast_tokenizers_decode_through_their_backend_as_hf_would(tokenizer):
    """A step decodes through the tokenizers backend (not transformers' Python layers) only
    where HF's ``decode`` returns the backend's text unchanged: the same text, special tokens
    skipped or kept; a tokenizer that cleans up spaces keeps HF's own decode."""
    import copy

    from specray.engine.request import _backend_decoder

    assert _backend_decoder(tokenizer) is tokenizer._tokenizer
    ids = tokenizer.encode("<|im_start|>user: déjà vu , ok ?<|im_end|> 東京", add_special_tokens=False)
    for skip in (True, False):
        req = Request("r", [1], SamplingParams(max_tokens=100, skip_special_tokens=skip), PlainOptions(), frozenset())
        for i in range(0, len(ids), 3):
            req.append(ids[i : i + 3], capacity=10**6, tokenizer=tokenizer)
        assert req.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<|im_start|>" in tokenizer.decode(ids, skip_special_tokens=False)
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert _backend_decoder(cleaning) is None
