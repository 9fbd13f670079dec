"""Structured outputs at engine level: the constrained target is the reference.

Its reference is computed here independently of the engine: the tiny target's logits at each
token, masked by a llguidance matcher driven token by token, argmax (greedy). Speculative
decoding under a constraint must give exactly that, for every method, in mixed batches.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from tests.conftest import ALPHABET

REGEX = "[a-f]{3}(x[0-9]{2}|yz)+"  # forces some tokens, leaves others to the model
CHOICES = ["alpha", "beta", "gamma", "abba"]


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def decode(ids) -> str:
    return "".join(ALPHABET[i] for i in ids)


@pytest.fixture()
def engine_for(tiny_pair, char_tokenizer):
    def make(max_num_seqs: int = 4, **kw):
        target, draft = tiny_pair
        return LLMEngine(EngineConfig(target="<in-memory>", max_num_seqs=max_num_seqs, **kw),
                         target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft),
                         tokenizer=char_tokenizer)

    return make


def constrained_greedy(model, tokenizer, prompt: list[int], constraint: dict, max_tokens: int) -> list[int]:
    """The reference: one target forward per token over the whole sequence, logits masked by
    llguidance's own matcher (no engine code), argmax; ends where the grammar is complete."""
    import llguidance
    import llguidance.torch as lt

    from specray.engine.grammar import Grammars, unpack

    grammars = Grammars(tokenizer, model.config.vocab_size, None)
    kind, value = next(iter(constraint.items()))
    matcher = llguidance.LLMatcher(grammars.ll_tokenizer, grammars.source(kind, value))
    bits = lt.allocate_token_bitmask(1, grammars.width)
    ids, out = list(prompt), []
    while len(out) < max_tokens and not matcher.is_stopped():
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        lt.fill_next_token_bitmask(matcher, bits, 0)
        allowed = unpack(bits, grammars.width)[0, : logits.shape[-1]]
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.consume_token(token)
        ids.append(token)
        out.append(token)
    return out


PROMPTS = [encode("abcabcab"), encode("hello"), encode("x0x1x2x3"), encode("QWERTY")]


def constrained_outputs_match(coordinator, target, tokenizer, methods) -> None:
    """Behind Ray: constrained and free rows in one batch per method, each as the reference."""
    import ray

    from tests.conftest import hf_greedy

    constraints = [{"regex": REGEX}, None, {"choice": CHOICES}]
    refs = [constrained_greedy(target, tokenizer, p, c, 12) if c else hf_greedy(target, p, 12)
            for p, c in zip(PROMPTS, constraints)]
    params = [{"max_tokens": 12, "temperature": 0, "ignore_eos": True, "structured_outputs": c} for c in constraints]
    for method in methods:
        outs = ray.get(coordinator.generate.remote(PROMPTS[:3], params, {"method": method}))
        assert [o["token_ids"] for o in outs] == refs, method


@pytest.mark.parametrize("method, k", [("none", None), ("draft", 4), ("ngram", 3)])
def test_greedy_constrained_speculation_is_the_constrained_target(engine_for, tiny_pair, char_tokenizer, method, k):
    """Constrained and free rows in one batch: each constrained row equals the reference, each
    free row plain greedy decoding."""
    from tests.conftest import hf_greedy

    engine = engine_for()
    constraints = [{"regex": REGEX}, None, {"choice": CHOICES}, {"regex": "[0-9a-z]{5,9}"}]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             structured_outputs=c) for c in constraints]
    spec = SpeculationParams(method=method, **({"num_speculative_tokens": k} if k else {}))
    outs = engine.generate(PROMPTS, params, spec)
    for prompt, c, out in zip(PROMPTS, constraints, outs):
        if c is None:
            assert out.token_ids == hf_greedy(tiny_pair[0], prompt, 20)
            assert out.metrics["grammar_mask_s"] is None and out.metrics["grammar_cut_tokens"] is None
            continue
        assert out.metrics["grammar_mask_s"] > 0 and out.metrics["grammar_compile_s"] >= 0
        ref = constrained_greedy(tiny_pair[0], char_tokenizer, prompt, c, 20)
        assert out.token_ids == ref, (c, decode(out.token_ids), decode(ref))
        if "choice" in c:
            assert decode(out.token_ids) in CHOICES and out.finish_reason == "stop"



# -- sampled: the constrained target's distribution ----------------------------------------------
SMALL = "abcdefgh"  # an 8-token vocabulary: every continuation can be enumerated
# What may follow depends on the path, and on some paths the grammar forces tokens (after b and
# a free one: g; after c: d, e, f), which the grammar drafter drafts.
SAMPLED_REGEX = "(a[a-d]|b[e-h]g|cdef|[d-h][ab])[a-c]+"
NEW, N = 4, 3000
SAMPLED = dict(max_tokens=NEW, temperature=0.9, top_k=6, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def small():
    """(target, draft, tokenizer) over SMALL."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import tiny_llama

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(SMALL)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    return tiny_llama(vocab=8, seed=3, init=0.25), tiny_llama(vocab=8, layers=1, seed=4, init=0.25), tokenizer


def constrained_joint(target, tokenizer, prompt: list[int]):
    """P(t1..t4) [8, 8, 8, 8] of the constrained target, by enumerating every prefix: each
    position's logits masked by a matcher that consumed that prefix, then the sampling
    parameters' distribution (the order the engine applies them)."""
    import functools
    import itertools

    import llguidance
    import llguidance.torch as lt
    import numpy as np

    from specray.engine.grammar import Grammars, unpack
    from specray.kernels.sampling import probs_from_logits

    grammars = Grammars(tokenizer, 8, None)
    source = grammars.source("regex", SAMPLED_REGEX)
    bits = lt.allocate_token_bitmask(1, grammars.width)

    @functools.lru_cache(maxsize=None)
    def next_probs(prefix: tuple) -> torch.Tensor:  # [8] the constrained target after prefix
        matcher = llguidance.LLMatcher(grammars.ll_tokenizer, source)
        assert matcher.consume_tokens(list(prefix))
        lt.fill_next_token_bitmask(matcher, bits, 0)
        allowed = unpack(bits, grammars.width)[0, :8]
        with torch.no_grad():
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        return probs_from_logits(logits.masked_fill(~allowed, float("-inf"))[None], torch.tensor([0.9]),
                                 torch.tensor([6]), torch.tensor([0.95]))[0]

    joint = np.zeros((8,) * NEW)
    for combo in itertools.product(range(8), repeat=NEW):
        p = 1.0
        for j, token in enumerate(combo):
            p *= float(next_probs(combo[:j])[token])
            if p == 0.0:
                break
        joint[combo] = p
    return joint


@pytest.fixture(scope="module")
def small_joint(small):
    return constrained_joint(small[0], small[2], PROMPT_SMALL)


PROMPT_SMALL = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]


TREE = {"method": "eagle", "eagle_choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}  # sampled nodes


@pytest.fixture(scope="module")
def small_engine(small):
    """One engine over SMALL for every method's sampled rows. Every row is seeded, so its request
    fixes its draft size (the budget decides nothing): no start-up cost profile."""
    from tests.test_eagle import self_head

    target, draft, tokenizer = small
    return LLMEngine(EngineConfig(target="x", max_num_seqs=64, profile_costs=False), target_model=copy.deepcopy(target),
                     draft_model=copy.deepcopy(draft), tokenizer=tokenizer, resources={"eagle": self_head(target)})


def small_samples(engine, method: str):
    import numpy as np

    from specray.engine.metrics import SpecMetrics

    engine.scheduler.totals = SpecMetrics()  # this method's counts alone
    params = [SamplingParams(seed=i, structured_outputs={"regex": SAMPLED_REGEX}, **SAMPLED) for i in range(N)]
    spec = SpeculationParams(**TREE) if method == "eagle" else SpeculationParams(method=method, num_speculative_tokens=3)
    outs = engine.generate([PROMPT_SMALL] * N, params, spec)
    t = engine.totals
    if method != "none":
        assert t.num_drafts > N // 4 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    assert 0 < t.grammar_forced_accepted <= t.grammar_forced_tokens  # the grammar drafted what it forces
    return np.array([o.token_ids for o in outs])


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "eagle"])
def test_sampled_constrained_speculation_follows_the_constrained_target(small_engine, small_joint, method):
    """Chi-square of each position's marginal and the first two tokens' joint against the exact
    constrained distribution. The draft model (a chain) and EAGLE's tree of sampled nodes draw
    from their own unconstrained q: a drafted token the grammar refuses is a rejection, its
    replacement drawn from max(0, p' - q) (a tree's siblings from the updated residual). Where
    the grammar forces tokens they are the row's draft instead (the grammar drafter): a
    deterministic draft (q one-hot), accepted with probability p'(token), 1 where the grammar
    allows nothing else."""
    from tests.test_sampling_e2e import check

    seqs = small_samples(small_engine, method)
    pvals = check(seqs, small_joint)
    assert min(pvals) > 1e-3, pvals
    if method in ("draft", "eagle"):  # the negative control: 20% repeating their first token fail it
        biased = seqs.copy()
        biased[: N // 5, 1:] = biased[: N // 5, :1]
        assert min(check(biased, small_joint)) < 1e-3


# -- the grammar as a drafter -------------------------------------------------------------------
FORCING = "name[a-z]{2,5}kind(alpha|beta|gamma)(x[0-9]{1,2})+end"  # literal runs between free spans


@pytest.mark.parametrize("step", ["eager", "static"])
def test_forced_tokens_drafted_for_free_keep_the_constrained_output(tiny_pair, char_tokenizer, step):
    """The grammar drafter on and off, plain decoding, prompt lookup and a draft model (chains)
    and EAGLE (a tree), constrained and free rows in one batch: each row is the constrained
    target's (or plain greedy) token for token either way. With it on the forced tokens are
    drafted, counted apart (drafted, accepted: a forced token is the masked target's only
    choice, or the tokenizer's spelling of the forced text) and fewer target forwards run."""
    from tests.conftest import hf_greedy
    from tests.test_eagle import self_head

    target, draft = tiny_pair
    constraints = [{"regex": FORCING}, {"choice": CHOICES}, None, {"regex": REGEX}]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, structured_outputs=c) for c in constraints]
    refs = [constrained_greedy(target, char_tokenizer, p, c, 24) if c else hf_greedy(target, p, 24)
            for p, c in zip(PROMPTS, constraints)]
    forwards = {}
    for on in (True, False):
        engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, step=step, grammar_drafter=on, profile_costs=False),
                           target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft),
                           tokenizer=char_tokenizer, resources={"eagle": self_head(target)})
        for spec in ({"method": "none"}, {"method": "ngram", "num_speculative_tokens": 3},
                     {"method": "draft", "num_speculative_tokens": 3}, {"method": "eagle"}):
            outs = engine.generate(PROMPTS, params, SpeculationParams(**spec))
            assert [o.token_ids for o in outs] == refs, (on, spec)
            forced = [o.metrics["grammar_forced_tokens"] for o in outs]
            accepted = [o.metrics["grammar_forced_accepted"] for o in outs]
            assert forced[2] is None and accepted[2] is None  # the free row
            if on:
                assert forced[0] > 0 and forced[1] > 0 and all(0 < a <= f for a, f in zip(accepted, forced) if f)
            else:
                assert forced == [0, 0, None, 0] and accepted == [0, 0, None, 0]
            forwards[on, spec["method"]] = outs[0].metrics["target_forward_passes"]
    assert forwards[True, "none"] < forwards[False, "none"], forwards


def test_a_methods_draft_is_kept_only_where_it_drafts_the_forced_tokens_and_more():
    """The forced tokens [5, 6] against each row's method draft: a deterministic chain or tree
    through them with a node below is kept; one that diverges, stops at them or carries draft
    probabilities (sampled: never chosen by its tokens) gives way to them; a row drafted on the
    device keeps its own."""
    from specray.engine.grammar import ForcedRow, with_forced
    from specray.kernels.tree import TokenTree
    from specray.policies.base import EMPTY, DraftRow

    f = ForcedRow([5, 6])
    tree = DraftRow([5, 9, 6, 7], TokenTree.from_parents([0, 0, 1, 3]))  # 5 -> 6 -> 7 beside 9
    rows = [DraftRow([5, 6, 7]), DraftRow([5, 8, 7]), DraftRow([5, 6]), DraftRow([5, 6, 7], probs=torch.rand(3, 8)),
            tree, DraftRow([5, 9, 6], TokenTree.from_parents([0, 0, 1])), EMPTY, DraftRow([1, 2, 3]), EMPTY]
    forced = [f] * 8 + [None]
    out = with_forced(rows, forced, on_device={7})
    assert [o is r for o, r in zip(out, rows)] == [True, False, False, False, True, False, False, True, True]
    assert all(isinstance(out[i], ForcedRow) for i in (1, 2, 3, 5, 6))


# -- every method ------------------------------------------------------------------------------
EVERY = [
    {"method": "draft", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "suffix"},
    {"method": "medusa", "tree": "trtllm_example"},
    {"method": "eagle"},
    {"method": "eagle", "dynamic_tree": True},
    {"method": "eagle3"},
    {"method": "redrafter"},
    {"method": "lookahead"},
    {"method": "pard", "num_speculative_tokens": 4},
    {"method": "dflash"},
]


@pytest.fixture(scope="module")
def every_method_engine(tiny_methods):
    def make(**kw):
        return LLMEngine(EngineConfig(**tiny_methods, max_num_seqs=4, **kw))

    return make


@pytest.mark.parametrize("step, paged", [("eager", True), ("static", True), ("eager", False)],
                         ids=["eager", "static", "contiguous KV"])
def test_every_method_greedy_under_a_constraint(every_method_engine, tiny_pair, char_tokenizer, step, paged):
    """Every method (trees: one mask per node, from its own path), constrained and free rows
    mixed in each batch, the eager and the fixed-shape step, paged KV with prefix caching (each
    method's batch finds the last one's prompts cached) and contiguous: the constrained
    target's text."""
    from tests.conftest import hf_greedy

    engine = every_method_engine(step=step, paged_kv=paged)
    constraints = [{"regex": REGEX}, {"choice": CHOICES}, None, {"regex": "([a-c]x|[0-9]{2})+z"}]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, structured_outputs=c)
              for c in constraints]
    refs = [constrained_greedy(tiny_pair[0], char_tokenizer, p, c, 16) if c else hf_greedy(tiny_pair[0], p, 16)
            for p, c in zip(PROMPTS, constraints)]
    drafted = cut = 0
    for spec in EVERY:
        outs = engine.generate(PROMPTS, params, SpeculationParams(**spec))
        assert [o.token_ids for o in outs] == refs, spec
        drafted += sum(o.metrics["num_draft_tokens"] for o in outs[:2] + outs[3:])
        cut += sum(o.metrics["grammar_cut_tokens"] for o in outs[:2] + outs[3:])  # rows 0, 1, 3 are constrained
    assert drafted > 0 and cut > 0  # deterministic chains were cut at a refused token


def test_online_learning_traces_say_a_grammar_applied(tiny_pair, char_tokenizer):
    """A captured trace of a constrained request is marked: its tokens are the masked target's."""
    from tests.test_online_learning import ONLINE

    target, draft = tiny_pair
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, online_learning=ONLINE), target_model=copy.deepcopy(target),
                       draft_model=copy.deepcopy(draft), tokenizer=char_tokenizer)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, structured_outputs=c)
              for c in ({"regex": "[a-z]{12}"}, None)]
    engine.generate(PROMPTS[:2], params, SpeculationParams(method="draft", num_speculative_tokens=3))
    traces = {tuple(t.tokens[: t.prompt_len]): t for t in engine.take_traces()}
    assert traces[tuple(PROMPTS[0])].constrained and not traces[tuple(PROMPTS[1])].constrained


def test_a_grammar_that_leaves_nothing_finishes_cleanly(engine_for, tiny_pair, char_tokenizer):
    """Where the grammar and another constraint exclude each other mid-way, or min_tokens holds
    back the stop token the grammar must end on, the request finishes with 'stop' — greedy and
    sampled, never NaN; the grammar's text so far is kept."""
    engine = engine_for()
    digits_only = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True, allowed_token_ids=encode("ab"),
                                 structured_outputs={"regex": "ab[0-9]"})
    held = SamplingParams(max_tokens=12, temperature=0, min_tokens=10, stop_token_ids=[encode("/")[0]],
                          structured_outputs={"choice": ["abba"]})
    greedy = digits_only.model_copy(update={"temperature": 0.0, "seed": None})
    for spec in ({"method": "none"}, {"method": "draft", "num_speculative_tokens": 3}):
        outs = engine.generate(PROMPTS[:3], [digits_only, held, greedy], SpeculationParams(**spec))
        assert [decode(o.token_ids) for o in outs] == ["ab", "abba/", "ab"], spec
        assert all(o.finish_reason == "stop" for o in outs), spec


def test_a_drafter_swapped_mid_request_keeps_the_constrained_output(tiny_pair, char_tokenizer):
    """Online learning swaps the draft model every other step (engine/drafter_versions.py):
    constrained rows still give the constrained target's text."""
    from tests.test_online_learning import ONLINE, run_with_swaps

    target, draft = tiny_pair
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, online_learning=ONLINE), target_model=copy.deepcopy(target),
                       draft_model=copy.deepcopy(draft), tokenizer=char_tokenizer)
    constraints = [{"regex": REGEX}, {"regex": "([a-c]x|[0-9]{2})+z"}, {"choice": CHOICES}]
    sampling = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, structured_outputs=c) for c in constraints]
    outs, swaps = run_with_swaps(engine, PROMPTS[:3], sampling, SpeculationParams(method="draft", num_speculative_tokens=3),
                                 "draft")
    assert swaps > 0
    for p, c, o in zip(PROMPTS, constraints, outs):
        assert o.token_ids == constrained_greedy(target, char_tokenizer, p, c, 16), c


# -- the anchors' reported failures, as cases ------------------------------------------------------
def test_a_drafted_stop_token_the_grammar_cannot_take_yet_is_refused(engine_for):
    """Prompt lookup keeps proposing the stop token '/' (the prompt repeats it) where the grammar
    cannot end yet (vLLM #46118's drafted special token): refused like any token; the output is
    plain constrained decoding's, and it ends on '/' only where the grammar is complete."""
    engine = engine_for()
    stop = encode("/")
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=stop, structured_outputs={"regex": "ab(ab){2,4}c"})
    prompt = encode("ab/ab/ab/ab/ab/ab")
    plain = engine.generate([prompt], params, SpeculationParams(method="none"))[0]
    spec = engine.generate([prompt], params, SpeculationParams(method="ngram", num_speculative_tokens=4))[0]
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "stop"
    text = decode(plain.token_ids)
    assert "/" not in text[:-1] and re.fullmatch("ab(ab){2,4}c/?", text), text


def test_many_constrained_tree_requests_at_once(every_method_engine, tiny_pair, char_tokenizer):
    """EAGLE-3 trees under a grammar for more requests than slots (vLLM #27969 crashed at
    concurrency 30): every row is the constrained target's, none fails."""
    engine = every_method_engine()
    prompts = [encode("abcdefgh"[i % 8:] + "xyz") for i in range(24)]
    constraint = {"regex": "[a-f]{2,5}(x[0-9]|yz)+"}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, structured_outputs=constraint)
    outs = engine.generate(prompts, params, SpeculationParams(method="eagle3"))
    for p, o in zip(prompts, outs):
        assert o.finish_reason in ("length", "stop") and o.token_ids == constrained_greedy(
            tiny_pair[0], char_tokenizer, p, constraint, 10)


@pytest.mark.slow  # the demo pair's tokenizer (JSON needs its punctuation)
def test_a_schemas_properties_come_in_its_order(demo_models):
    """Compiled grammars are cached by the schema as given: key order kept, since a schema's
    properties are generated in their order."""
    from specray.engine.grammar import Grammars

    tok = demo_models[2]
    grammars = Grammars(tok, len(tok), tok.eos_token_id)
    for names in (("name", "age"), ("age", "name")):
        schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
                  "required": list(names), "additionalProperties": False}
        row = grammars.matcher(grammars.source("json", schema), frozenset())
        text = "{" + ", ".join(f'"{n}": {i}' for i, n in enumerate(names)) + "}"
        ids = tok.encode(text, add_special_tokens=False)
        assert row.valid_prefix(ids) == len(ids), (names, text)


def test_a_structural_tag_constrains_only_its_segments(engine_for, tiny_pair, char_tokenizer):
    """vLLM's structural tag: free text, and where a structure's begin appears, its schema up to
    its end — the constrained target's text under speculation too."""
    tag = {"structures": [{"begin": "ab", "schema": {"type": "integer", "minimum": 0, "maximum": 999}, "end": "Z"}],
           "triggers": ["a"]}
    engine = engine_for()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, structured_outputs={"structural_tag": tag})
    prompt = encode("abc1Zxyab7Zab")
    ref = constrained_greedy(tiny_pair[0], char_tokenizer, prompt, {"structural_tag": tag}, 24)
    for spec in ({"method": "none"}, {"method": "draft", "num_speculative_tokens": 3}, {"method": "ngram"}):
        out = engine.generate([prompt], params, SpeculationParams(**spec))[0]
        assert out.token_ids == ref, spec
    for segment in re.findall("ab(.*?)(?:Z|$)", decode(ref)):
        assert re.fullmatch("[0-9]{0,3}", segment), decode(ref)
