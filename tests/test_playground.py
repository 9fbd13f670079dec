"""The playground: per-step speculation events in streams (``stream_options.
include_speculation``), the page and its method list, and the page in a real browser.

Events are checked three ways: against the engine's own request logic (``Request``, its
incremental detokenisation and stop strings) with a byte-level tokenizer whose characters
span several tokens, no server; over HTTP on the tiny pair, whose one-character-per-token
tokenizer makes text identify token ids exactly; and in headless Chromium (Debian's
``chromium`` + ``chromium-driver``, driven by selenium), which skips only where no browser
can be started. Screenshots go to the test's tmp dir and, when ``$SPECRAY_ARTIFACTS`` is
set, there too (``SPECRAY_ARTIFACTS=docs pytest tests/test_playground.py -k demo`` remakes
the README's ``docs/playground.png``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import time

import httpx
import pytest

from tests.conftest import ALPHABET, decode
from tests.serving import AUTH, GUARDED as MODEL, KEY, sse_events

serve = pytest.importorskip("ray.serve")

from specray.serve.playground import SpeculationTrack  # noqa: E402

pytestmark = pytest.mark.timeout(600)
CHUNK_KEYS = {"id", "object", "created", "model", "choices"}


# -- events against the engine's request logic (no server) ----------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE symbols)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE: one token per byte (so é and ☕ span 2 and 3 tokens) plus a few merges
    (multi-character tokens: 'def', ' ret')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbol = _bytes_to_unicode()
    vocab, merges = {symbol[b]: b for b in range(256)}, []
    for a, b in (("d", "e"), ("de", "f"), (symbol[32], "r"), ("e", "t"), (symbol[32] + "r", "et")):
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


TEXT = "def café ☕ ret\n    ret ☕☕ é + défé\ndef x(): ret 'é☕'\n"


def engine_outputs(tok, sizes, stop):
    """The step outputs the engine makes for TEXT's tokens emitted ``sizes`` at a time (each
    step: its tokens but the last accepted, the last the target's own, and — on odd sizes — a
    rejected draft), through the engine's own Request (detokenisation, stop strings)."""
    from specray.engine.params import SamplingParams, SpeculationParams
    from specray.engine.request import Request, speculation_event

    ids = tok.encode(TEXT, add_special_tokens=False)
    req = Request("r", [1], SamplingParams(max_tokens=len(ids), stop=stop), SpeculationParams(method="draft"),
                  frozenset())
    outs, at = [], 0
    for size in sizes:
        emitted = ids[at:at + size]
        at += size
        kept = req.append(emitted, 10_000, tok)
        rejected = [(emitted[-1] + 7) % 256] if size % 2 else []
        drafted = emitted[:-1] + rejected
        event = speculation_event("draft", drafted, rejected, len(emitted) - 1, kept, len(drafted))
        outs.append(dataclasses.asdict(req.output(kept, event)))
        if req.finished or at >= len(ids):
            break
    return outs, req


def sse_text(track, outs, max_stop):
    """What ``_sse`` sends for these outputs: [(chunk text, its steps)]."""
    sent, chunks = 0, []
    for out in outs:
        upto, steps = track.advance(out, sent, max_stop)
        chunks.append((out["text"][sent:upto], steps))
        sent = upto
    return chunks


def old_sse_text(outs, max_stop) -> str:
    """The stream's text without the option (the ingress's holdback rule)."""
    sent, text = 0, ""
    for out in outs:
        t = out["text"]
        upto = len(t) if out["finished"] or not max_stop else max(sent, len(t) - max_stop + 1)
        text += t[sent:upto]
        sent = upto
    return text


def emitted(steps) -> list[dict]:
    return [t for s in steps for t in s["accepted"] + ([s["bonus"]] if s["bonus"] else [])]


STOPS = [[], ["☕"], ["é ☕"], ["ret\n"], ["f c", "ret 'é"], ["x()"], ["\x00never"]]


@pytest.mark.parametrize("stop", STOPS, ids=[repr(s) for s in STOPS])
def test_events_tile_the_text_with_stop_strings_and_split_characters(byte_tokenizer, stop):
    tok = byte_tokenizer
    expected = TEXT[:min([TEXT.find(s) for s in stop if s in TEXT], default=len(TEXT))]
    rng = random.Random(sum(map(ord, "".join(stop))))
    for _ in range(25):
        sizes = [rng.randint(1, 5) for _ in range(len(TEXT))]
        outs, req = engine_outputs(tok, sizes, stop)
        assert req.text == expected  # the engine's own cut (the stop string excluded)
        max_stop = max(map(len, stop), default=0)
        chunks = sse_text(SpeculationTrack(tok), outs, max_stop)
        for text, steps in chunks:
            assert text == "".join(t["text"] for t in emitted(steps))  # each chunk: exactly its steps
        steps = [s for _, s in chunks for s in s]
        assert "".join(text for text, _ in chunks) == expected == old_sse_text(outs, max_stop)
        assert [t["id"] for t in emitted(steps)] == req.output_ids  # every emitted token, in order
        assert len(steps) == len(outs)
        for s, out in zip(steps, outs):
            assert s["num_accepted"] == len(s["accepted"]) and s["method"] == "draft"
            assert [t["id"] for t in s["rejected"]] == out["step"]["rejected"]
            assert all(t["text"] == tok.decode([t["id"]]) for t in s["drafted"] + s["rejected"])
        for s in stop:
            assert all(s not in t["text"] for t in emitted(steps))


def test_a_character_split_across_steps_belongs_to_the_token_that_completes_it(byte_tokenizer):
    tok = byte_tokenizer
    outs, _ = engine_outputs(tok, [1] * 20, [])  # one token per step: ☕'s three bytes in three steps
    texts = [t["text"] for _, steps in sse_text(SpeculationTrack(tok), outs, 0) for t in emitted(steps)]
    ids = tok.encode(TEXT, add_special_tokens=False)[:len(texts)]
    coffee = tok.encode("☕", add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i:i + 3] == coffee)
    assert texts[at:at + 3] == ["", "", "☕"]
    assert "".join(texts) == tok.decode(ids).rstrip("\ufffd")  # a last incomplete character waits


# -- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(guarded_url):
    """The session's guarded app: the tiny pair (draft model and n-gram actors), an API key."""
    return guarded_url


def post(url, path, body, stream=False):
    """(non-streamed JSON) or (SSE events) of one request."""
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def chunk_text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def request_body(chat: bool, **kw) -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "abcabcab"}], **kw}
    return "/v1/completions", {"model": MODEL, "prompt": "abcabcab", **kw}


def check_events(events: list, full_text: str) -> list[dict]:
    """Every chunk's text is its steps' accepted + bonus texts; they add up to the completion;
    returns the steps."""
    steps, text = [], ""
    for e in events:
        if not e["choices"]:
            continue
        (choice,) = e["choices"]
        assert chunk_text(choice) == "".join(t["text"] for t in emitted(choice.get("speculation", [])))
        steps += choice.get("speculation", [])
        text += chunk_text(choice)
    assert text == full_text
    return steps


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("method", ["draft", "ngram", "none"])
def test_stream_events_match_the_completion(url, chat, method):
    path, body = request_body(chat, max_tokens=40, temperature=0,
                              speculation={"method": method, "num_speculative_tokens": 3})
    full = post(url, path, body)
    ref = full["choices"][0]["text" if not chat else "message"]
    ref = ref if not chat else ref["content"]
    events = post(url, path, {**body, "stream_options": {"include_speculation": True}}, stream=True)
    steps = check_events(events, ref)
    ids = [t["id"] for t in emitted(steps)]
    assert decode(ids) == ref and len(ids) == 40  # one character per token id
    at = 0
    for s in steps:
        assert s["method"] == method and s["num_accepted"] == len(s["accepted"])
        line = [t["id"] for t in s["drafted"]]
        assert line == [t["id"] for t in s["accepted"]] + [t["id"] for t in s["rejected"]]  # a chain
        at += s["num_accepted"]
        if s["rejected"]:  # the target said no there: its own token took that place
            assert s["recovered"] and s["bonus"]["id"] == ids[at] != s["rejected"][0]["id"]
        at += 1 if s["bonus"] else 0
        assert all(t["text"] == ALPHABET[t["id"]] for t in s["drafted"])
    # The stream's steps are the request's speculation metrics (greedy: the same drafts).
    (metrics,) = full["speculation_metrics"]
    drafting = [s for s in steps if s["num_drafted"]]
    assert len(drafting) == metrics["num_drafts"]
    assert sum(s["num_drafted"] for s in drafting) == metrics["num_draft_tokens"]
    assert sum(s["num_accepted"] for s in drafting) == metrics["num_accepted_tokens"]
    assert steps[0]["num_drafted"] == 0 and steps[0]["bonus"]["id"] == ids[0]  # prefill: the target's token
    if method == "none":
        assert not drafting
    else:
        assert drafting and all(s["num_drafted"] <= 3 for s in drafting)


def test_stop_strings_cut_events_where_the_text_ends(url):
    path, body = request_body(False, max_tokens=40, temperature=0, speculation={"method": "ngram"})
    text = post(url, path, body)["choices"][0]["text"]
    for stop in (text[12:15], text[20:21], [text[5:7], text[30:33]]):
        cut = post(url, path, {**body, "stop": stop})["choices"][0]["text"]
        stops = [stop] if isinstance(stop, str) else stop
        assert cut == text[:min(text.find(s) for s in stops)]
        events = post(url, path, {**body, "stop": stop, "stream_options": {"include_speculation": True}}, stream=True)
        steps = check_events(events, cut)
        tokens = emitted(steps)
        assert all(s not in t["text"] for s in stops for t in tokens)
        # The tokens that spell the stop string are listed, their text cut to "".
        assert decode([t["id"] for t in tokens]).startswith(cut) and len(tokens) > len(cut)
        assert all(t["text"] == "" for t in tokens[len(cut):])
        plain = post(url, path, {**body, "stop": stop}, stream=True)
        assert "".join(chunk_text(e["choices"][0]) for e in plain if e["choices"]) == cut


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_chunks_without_the_option_are_exactly_openais(url, chat):
    path, body = request_body(chat, max_tokens=12, temperature=0, speculation={"method": "draft"},
                              stream_options={"include_usage": True})
    choice_keys = {"index", "text" if not chat else "delta", "finish_reason", "logprobs"}
    for options in (None, {"include_usage": True, "include_speculation": False}):
        events = post(url, path, {**body, "stream_options": options}, stream=True)
        for e in events:
            assert set(e) == CHUNK_KEYS | ({"usage"} if "usage" in e else set())
            for c in e["choices"]:
                assert choice_keys - {"logprobs"} <= set(c) <= choice_keys  # (the chat role chunk has none)
                assert not chat or set(c["delta"]) <= {"role", "content"}
        assert all("speculation" not in json.dumps(e) for e in events)
    with_events = post(url, path, {**body, "stream_options": {"include_speculation": True}}, stream=True)
    assert all(set(c) == choice_keys | {"speculation"} for e in with_events for c in e["choices"]
               if chunk_text(c) or c["finish_reason"])
    text = lambda evs: "".join(chunk_text(c) for e in evs for c in e["choices"])  # noqa: E731
    assert text(events) == text(with_events) and len(text(events)) == 12


def test_each_choice_carries_its_own_steps(url):
    body = {"model": MODEL, "prompt": "xyzxyz", "max_tokens": 16, "temperature": 0.9, "n": 2, "seed": 5,
            "speculation": {"method": "draft", "num_speculative_tokens": 2}}
    full = post(url, "/v1/completions", body)
    events = post(url, "/v1/completions", {**body, "stream_options": {"include_speculation": True}}, stream=True)
    for c in full["choices"]:
        mine = [{**e, "choices": [x for x in e["choices"] if x["index"] == c["index"]]} for e in events]
        check_events(mine, c["text"])


def test_stream_options_are_checked(url):
    for options, param in (({"include_speculation": "often"}, "stream_options.include_speculation"),
                           ({"include_speculations": True}, "stream_options.include_speculations")):
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True, "stream_options": options}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_methods_listing_needs_the_key_and_says_what_is_available(url):
    assert httpx.get(f"{url}/playground/methods", timeout=60).status_code == 401
    data = httpx.get(f"{url}/playground/methods", headers=AUTH, timeout=60).json()
    assert data["model"] == MODEL
    methods = {m["name"]: m for m in data["methods"]}
    from specray.policies.registry import registered_methods

    assert sorted(methods) == registered_methods()
    assert all(methods[m]["available"] for m in ("none", "draft", "ngram", "lookahead"))
    assert methods["draft"]["k"] and not methods["none"]["k"] and not methods["medusa"]["k"]
    assert not methods["medusa"]["available"] and "medusa" in methods["medusa"]["requirement"].lower()
    assert {"chain", "wide"} <= set(methods["medusa"]["trees"]) and "mc_sim_7b_63" in methods["eagle"]["trees"]
    assert "mc_sim_7b_63" not in methods["medusa"]["trees"] and methods["draft"]["trees"] == []
    # The options box's placeholder is the selected method's own (it once showed EAGLE's
    # {"dynamic_tree": true} under draft): none for draft and none (the box is hidden).
    assert methods["draft"]["example"] == methods["none"]["example"] == ""
    for name in ("eagle", "lookahead", "ngram", "suffix"):
        example = json.loads(methods[name]["example"])
        assert example and set(example) <= set(methods[name]["options"]) - {"num_speculative_tokens", "tree"}, name
    assert json.loads(methods["lookahead"]["example"]) == {"window_size": 3, "ngram_size": 5}


def test_the_page_takes_the_options_placeholder_from_the_selected_method():
    static = pathlib.Path(__file__).resolve().parents[1] / "serve" / "static"
    html, js = (static / "playground.html").read_text(), (static / "playground.js").read_text()
    assert "dynamic_tree" not in html and 'class="options" type="text">' in html  # no fixed placeholder
    assert "options.placeholder = m ? m.example" in js and '.hidden = !m || !m.example' in js


def test_the_page_is_served_offline_without_a_key(url):
    page = httpx.get(f"{url}/playground", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(refs) == 2
    for ref in refs:
        assert not re.match(r"^(/|[a-z]+:)", ref), ref  # relative: works under any route prefix
        asset = httpx.get(f"{url}/{ref}", timeout=60)
        assert asset.status_code == 200 and asset.text
        # Nothing fetched from elsewhere (the SVG namespace is a name, not a download).
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", asset.text), ref
    assert httpx.get(f"{url}/playground/static/..%2Fingress.py", timeout=60).status_code == 404
    assert httpx.get(f"{url}/playground/static/nope.js", timeout=60).status_code == 404


def test_static_files_are_in_the_wheel_package_data():
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["specray.serve"]
    static = pathlib.Path(__file__).resolve().parents[1] / "serve" / "static"
    shipped = {p.name for pattern in patterns for p in static.parent.glob(pattern)}
    assert {"playground.html", "playground.js", "playground.css"} <= shipped


# -- a real browser -------------------------------------------------------------------------
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through selenium; skips (saying why) only when none can start."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    driver_path = shutil.which("chromedriver") or (CHROMEDRIVER if os.path.exists(CHROMEDRIVER) else None)
    if binary is None or driver_path is None:
        pytest.skip("no Chromium here: apt-get install -y chromium chromium-driver (see .ci/run)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1000"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as exc:  # noqa: BLE001 - any failure to start means: no browser here
        pytest.skip(f"Chromium did not start: {str(exc).splitlines()[0]}")
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            shown = driver.execute_script("return document.querySelector('#error').textContent")
            raise AssertionError(f"timed out waiting for {what}; the page's error box: {shown!r}")
        time.sleep(0.1)


def save_screenshot(driver, tmp_path, name: str) -> pathlib.Path:
    path = tmp_path / name
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
    if os.environ.get("SPECRAY_ARTIFACTS"):
        out = pathlib.Path(os.environ["SPECRAY_ARTIFACTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / name)
    return path


def fill(element, value) -> None:
    element.clear()
    element.send_keys(str(value))


def configure(driver, panel: str, method: str, k=None, temperature=0) -> None:
    from selenium.webdriver.support.ui import Select

    root = driver.find_element("id", f"run-{panel}")
    Select(root.find_element("css selector", ".method")).select_by_value(method)
    if k is not None:
        fill(root.find_element("css selector", ".k"), k)
    fill(root.find_element("css selector", ".temperature"), temperature)


def run_and_wait(driver, panels=("a",)) -> None:
    for p in panels:
        driver.execute_script(f"document.querySelector('#run-{p}').dataset.state = 'queued'")
    driver.find_element("id", "run").click()
    for p in panels:
        state = lambda: driver.find_element("id", f"run-{p}").get_attribute("data-state")  # noqa: E731
        wait_for(driver, lambda: state() in ("done", "error"), f"run {p}")
        assert state() == "done", driver.find_element("id", "error").text


def dom_text(driver, panel: str) -> str:
    """The completion as the page shows it: its token spans, rejected drafts left out."""
    return driver.execute_script(
        f"return Array.from(document.querySelectorAll('#run-{panel} .completion .tok:not(.rejected)'),"
        " t => t.textContent).join('')")


def count(driver, selector: str) -> int:
    return len(driver.find_elements("css selector", selector))


def test_playground_in_a_real_browser(browser, url, tmp_path):
    driver = browser
    driver.get(f"{url}/playground")
    # The server has a key: listing the methods is refused, so the page asks for it.
    key_box = driver.find_element("id", "key-box")
    wait_for(driver, key_box.is_displayed, "the API key prompt")
    assert "API key" in key_box.text
    fill(driver.find_element("id", "api-key"), KEY)
    driver.find_element("id", "key-submit").click()
    wait_for(driver, lambda: count(driver, "#run-a .method option") >= 3, "the method list")
    assert not key_box.is_displayed()
    assert driver.find_element("css selector", "#run-a .method option[value=medusa]").get_attribute("disabled")
    # The options box follows the method: hidden for draft (no options beyond k), its own example for lookahead.
    configure(driver, "a", "draft")
    assert not driver.find_element("css selector", "#run-a .options-field").is_displayed()
    configure(driver, "a", "lookahead")
    box = driver.find_element("css selector", "#run-a .options")
    assert box.is_displayed() and box.get_attribute("placeholder") == '{"window_size": 3, "ngram_size": 5}'

    # A rejected request shows the server's message.
    fill(driver.find_element("id", "prompt"), "hello")
    fill(driver.find_element("id", "max-tokens"), 48)
    configure(driver, "a", "ngram", k=3, temperature=5)
    driver.find_element("id", "run").click()
    error = driver.find_element("id", "error")
    wait_for(driver, error.is_displayed, "the error message")
    assert "400" in error.text and "temperature" in error.text

    # Greedy prompt lookup, k=3 (the tiny random draft model is never right; the tiny
    # target repeats itself, so lookup is): the page's text is the non-streamed completion.
    configure(driver, "a", "ngram", k=3, temperature=0)
    driver.find_element("id", "keep-rejected").click()
    run_and_wait(driver)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 48, "temperature": 0,
            "speculation": {"method": "ngram", "num_speculative_tokens": 3}}
    expected = post(url, "/v1/completions", body)["choices"][0]["text"]
    assert dom_text(driver, "a") == expected
    assert not error.is_displayed()
    assert count(driver, "#run-a .tok.accepted") > 0 and count(driver, "#run-a .tok.rejected") > 0
    assert count(driver, "#run-a .tok.target") > 0
    assert driver.execute_script(
        "return Array.from(document.querySelectorAll('#run-a .completion .tok[data-id]'), t => +t.dataset.id)"
    ) == [ALPHABET.index(c) for c in expected]
    stat = lambda name: driver.find_element("css selector", f"#run-a .stat-{name}").text  # noqa: E731
    assert stat("tokens") == "48" and float(stat("tps")) > 0 and float(stat("mal")) >= 1
    assert int(stat("steps")) < 48 + 1 and stat("acceptance").endswith("%")
    assert 1 <= count(driver, "#run-a .chart rect.bar") <= 3  # a bar per draft position (k = 3)
    save_screenshot(driver, tmp_path, "playground-tiny.png")

    # Compare: draft against plain decoding, side by side, same text (lossless), speeds shown.
    driver.find_element("id", "compare").click()
    configure(driver, "b", "none")
    run_and_wait(driver, ("a", "b"))
    assert dom_text(driver, "a") == dom_text(driver, "b") == expected
    verdict = driver.find_element("id", "verdict")
    assert verdict.is_displayed() and "tokens/s" in verdict.text and "identical text" in verdict.text
    assert count(driver, "#run-b .tok.accepted") == 0 and driver.find_element(
        "css selector", "#run-b .stat-steps").text == "48"  # plain: one token per step
    save_screenshot(driver, tmp_path, "playground-tiny-compare.png")


# -- the demo pair: a realistic page (and the README's screenshot) --------------------------
@pytest.mark.slow
def test_playground_demo_pair_screenshot(browser, demo_url, tmp_path):
    driver = browser
    driver.get(f"{demo_url}/playground")
    wait_for(driver, lambda: count(driver, "#run-a .method option") >= 3, "the method list")
    prompt = "def fibonacci(n):\n    "
    fill(driver.find_element("id", "prompt"), prompt)
    fill(driver.find_element("id", "max-tokens"), 96)
    if not driver.find_element("id", "keep-rejected").is_selected():
        driver.find_element("id", "keep-rejected").click()
    if not driver.find_element("id", "compare").is_selected():
        driver.find_element("id", "compare").click()
    configure(driver, "a", "draft", k=4)
    configure(driver, "b", "none")
    run_and_wait(driver, ("a", "b"))
    body = {"model": "specray-demo", "prompt": prompt, "max_tokens": 96, "temperature": 0,
            "speculation": {"method": "none"}}
    expected = post(demo_url, "/v1/completions", body)["choices"][0]["text"]
    assert dom_text(driver, "a") == dom_text(driver, "b") == expected
    assert count(driver, "#run-a .tok.accepted") > 10 and count(driver, "#run-a .tok.rejected") > 0
    save_screenshot(driver, tmp_path, "playground.png")
