"""PARD (the parallel draft model): vLLM's spellings, one draft forward per step with the masks'
KV discarded, lossless greedy (batch 1 and 8, ragged prompts, mixed with other methods, eager
and static steps, one host read per step), exact sampling, the published config keys, overlap
in the separate draft worker, and every entry point."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.runner import ModelRunner
from specray.policies.base import ProposalRow
from specray.policies.pard import PardOptions, PardProposer, mask_token_of
from specray.policies.registry import parse_speculation
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts

MASK = 63  # the tiny vocabulary's last id stands for the mask token


def pard_model(model, mask: int = MASK, trained: int | None = None):
    """A copy of ``model`` configured as a PARD model (its config names the mask token)."""
    m = copy.deepcopy(model)
    m.config.pard_token = mask
    if trained is not None:
        m.config.pard_max_tokens = trained
    return m


def pard_engine(target, pard, max_num_seqs: int = 4, step: str = "eager", draft=None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, step=step, **kw),
                     target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft) if draft else None,
                     resources={"pard": ModelRunner(copy.deepcopy(pard), max_num_seqs, 256)})


def test_vllm_spellings_select_pard():
    assert parse_speculation({"method": "draft_model", "parallel_drafting": True}).method == "pard"
    assert parse_speculation({"method": "draft", "parallel_drafting": True, "num_speculative_tokens": 6}) \
        == PardOptions(num_speculative_tokens=6)
    assert parse_speculation({"method": "draft", "parallel_drafting": False}).method == "draft"
    assert parse_speculation({"method": "draft_model"}).method == "draft"
    with pytest.raises(ValueError, match="parallel_drafting"):
        parse_speculation({"method": "draft", "parallel_drafting": "yes"})
    with pytest.raises(ValueError, match="method draft"):
        parse_speculation({"method": "pard", "parallel_drafting": False})
    assert mask_token_of({"pard_token": 5}) == 5 and mask_token_of({"ptd_token_id": 4}) == 4
    assert mask_token_of({"dflash_config": {"mask_token_id": 3}, "pard_token": 5}) == 3  # vLLM's order
    assert mask_token_of({"pard_token": True}) is None and mask_token_of({}) is None


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_pard_equals_hf_generate_batch_8(tiny_pair, references, step, k):
    target, draft = tiny_pair
    engine = pard_engine(target, pard_model(draft), max_num_seqs=8, step=step,
                         speculation_length=SpeculationLengthPolicy())
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="pard", num_speculative_tokens=k))
    assert [o.token_ids for o in outs] == references
    assert engine.totals.num_drafts > 0 and engine.totals.num_draft_tokens >= engine.totals.num_drafts * min(k, 2)


def test_greedy_pard_batch_1_and_joins(tiny_pair, references):
    """One slot: requests run one after another in a reused slot (the cache starts over)."""
    target, draft = tiny_pair
    engine = pard_engine(target, pard_model(draft), max_num_seqs=1)
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="pard", num_speculative_tokens=4))
    assert [o.token_ids for o in outs] == references


def test_one_forward_per_step_and_the_masks_kv_discarded(tiny_pair, references):
    """The target as its own PARD model: the first position is always right (it is the
    target's own next token), so every step accepts at least one. Each step is one forward of
    the PARD model over the whole batch, after which its cache holds exactly the committed
    tokens (the masks' KV is gone)."""
    target, _ = tiny_pair
    engine = pard_engine(target, pard_model(target), max_num_seqs=4, speculation_length=SpeculationLengthPolicy())
    proposer = engine.proposers.get("pard")
    forwards, checked = [], []
    forward, propose = proposer.runner.forward, proposer.propose
    proposer.runner.forward = lambda *a, **kw: forwards.append(1) or forward(*a, **kw)

    def checked_propose(rows):
        before = len(forwards)
        backlog = any(len(r.token_ids) - proposer.runner.lengths[r.slot] > 4 or proposer.runner.lengths[r.slot]
                      >= len(r.token_ids) for r in rows)  # (a reused slot starts over)
        draft = propose(rows)
        assert len(forwards) - before == 1 or backlog  # a long backlog (a new prompt) is fed first
        assert all(proposer.runner.lengths[r.slot] == len(r.token_ids) for r in rows)
        checked.append(len(rows))
        return draft

    proposer.propose = checked_propose
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="pard", num_speculative_tokens=5))
    assert [o.token_ids for o in outs] == references and len(checked) > 5
    totals = engine.totals
    assert totals.num_accepted_tokens >= totals.num_drafts, (totals.num_accepted_tokens, totals.num_drafts)


@pytest.mark.parametrize("guess", ["came true", "missed"])
def test_drafting_ahead_equals_drafting_afresh(tiny_pair, guess):
    """Overlapped drafting in one process: the draft made ahead (the whole draft fed, the bonus
    guessed) equals a fresh model's draft for the assumed tokens; when the guess misses, the
    cache keeps the accepted tokens only and the next draft equals a fresh one again."""
    from specray.engine.runner import ModelRunner
    from specray.policies.base import CommitRow

    model = pard_model(tiny_pair[0])  # the target drafting for itself: its first position is right

    def fresh(tokens, k=3):
        return PardProposer(ModelRunner(copy.deepcopy(model), 1, 64)).propose([ProposalRow(0, tokens, k)]).rows[0]

    proposer = PardProposer(ModelRunner(copy.deepcopy(model), 1, 64))
    tokens = ragged_prompts(1)[0] + [7]
    draft = proposer.propose([ProposalRow(0, tokens, 3)])
    assert draft.rows[0].tokens == fresh(tokens).tokens
    (assumed, following), = proposer.propose_ahead([ProposalRow(0, tokens, 3)], draft).values()
    assert assumed[:3] == draft.rows[0].tokens and following.tokens == fresh(tokens + assumed).tokens
    if guess == "came true":
        proposer.commit([CommitRow(0, assumed, [0, 1, 2, 3])])
        assert proposer.runner.lengths[0] == len(tokens + assumed)
        nxt = tokens + assumed
    else:
        emitted = [draft.rows[0].tokens[0], (draft.rows[0].tokens[1] + 1) % 60]  # one accepted, then another token
        proposer.commit([CommitRow(0, emitted, [0, 1])])
        assert proposer.runner.lengths[0] == len(tokens) + 1  # the accepted draft token's KV kept
        nxt = tokens + emitted
    assert proposer.propose([ProposalRow(0, nxt, 3)]).rows[0].tokens == fresh(nxt).tokens


def test_pard_mixes_with_other_methods_in_one_batch(tiny_pair, references):
    target, draft = tiny_pair
    engine = pard_engine(target, pard_model(draft), max_num_seqs=4, draft=draft)
    specs = [SpeculationParams(method="pard", num_speculative_tokens=4), SpeculationParams(method="draft"),
             SpeculationParams(method="ngram"), SpeculationParams(method="none"),
             SpeculationParams(method="draft_model", parallel_drafting=True)]
    outs = engine.generate(ragged_prompts(8), GREEDY, [specs[i % len(specs)] for i in range(8)])
    assert [o.token_ids for o in outs] == references


def test_static_step_reads_the_device_once(tiny_pair):
    from tests.test_static_step import reads_per_step

    target, draft = tiny_pair
    engine = pard_engine(target, pard_model(draft), step="static", speculation_length=SpeculationLengthPolicy())
    for p in ragged_prompts(4):
        engine.add_request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                           SpeculationParams(method="pard", num_speculative_tokens=4))
    reads = reads_per_step(engine)
    assert len(reads) >= 3 and max(reads) == 1, reads


def test_trained_length_caps_k(tiny_pair):
    target, draft = tiny_pair
    engine = pard_engine(target, pard_model(draft, trained=3))
    with pytest.raises(ValueError, match="trained for"):
        engine.add_request([1, 2, 3], GREEDY, SpeculationParams(method="pard", num_speculative_tokens=4))
    # the self-tuning length may ask for more: the proposer drafts at most what it was trained for
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="pard"))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    assert engine.totals.num_draft_tokens <= 3 * engine.totals.num_drafts


def test_sampling_keeps_the_target_distribution():
    """Each position is drawn from the PARD model's own distribution there and carries it as q
    (through the device acceptance of the static step; the host's rule is the draft model's,
    tests/test_sampling_e2e.py)."""
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, assert_follows

    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    # The target as its own PARD model: its first position is the target's distribution (often
    # accepted), the masked ones are not (rejections): both paths of the rule run.
    engine = pard_engine(target, pard_model(target, mask=VOCAB - 1), max_num_seqs=64, step="static",
                         speculation_length=SpeculationLengthPolicy())
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params, SpeculationParams(method="pard", num_speculative_tokens=3))
    t = engine.totals
    assert t.num_drafts > N // 2 and N // 10 < t.num_accepted_tokens < t.num_draft_tokens
    assert_follows(np.array([o.token_ids for o in outs]), target)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_pair):
    target, draft = tiny_pair
    spec = SpeculationParams(method="pard", num_speculative_tokens=3)
    sampling = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    alone = pard_engine(target, pard_model(draft), max_num_seqs=1).generate([[1, 2, 3]], sampling, spec)[0]
    crowd = pard_engine(target, pard_model(draft), max_num_seqs=4).generate(
        [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [sampling, sampling.model_copy(update={"seed": 1}),
                                            sampling.model_copy(update={"seed": 2})], spec)[0]
    assert alone.token_ids == crowd.token_ids


# -- the published layout ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pard_dir(tiny_pair, tmp_path_factory):
    """A PARD checkpoint as AMD publishes one: a causal LM with ``pard_token`` in config.json."""
    path = tmp_path_factory.mktemp("pard")
    model = pard_model(tiny_pair[1])
    model.config.spd_type = "pard"
    model.save_pretrained(path)
    return str(path)


def test_published_checkpoint_loads_and_bad_ones_are_refused(tiny_pair, pard_dir, tmp_path):
    from specray.engine.checkpoints import checkpoint_problems

    raw = json.loads(open(f"{pard_dir}/config.json").read())
    assert raw["pard_token"] == MASK and "pard_max_tokens" not in raw
    engine = LLMEngine(EngineConfig(target="x", checkpoints={"pard": pard_dir}, max_num_seqs=2),
                       target_model=copy.deepcopy(tiny_pair[0]))
    assert isinstance(engine.proposers.get("pard"), PardProposer) and engine.proposers.get("pard").mask == MASK
    outs = engine.generate(ragged_prompts(2), GREEDY, SpeculationParams(method="draft", parallel_drafting=True))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair[0], p, GREEDY.max_tokens) for p in ragged_prompts(2)]
    plain = tmp_path / "plain"
    tiny_pair[1].save_pretrained(plain)  # an ordinary draft model: no mask token
    target_dir = tmp_path / "target"
    tiny_pair[0].save_pretrained(target_dir)
    problems = checkpoint_problems(EngineConfig(target=str(target_dir), checkpoints={"pard": str(plain)}))
    assert any("pard_token" in p.message and "--draft" in p.message for p in problems), problems
    assert not checkpoint_problems(EngineConfig(target=str(target_dir), checkpoints={"pard": pard_dir}))


def test_pard_has_a_bundle_and_kv_of_its_own(tiny_checkpoints, pard_dir):
    """Separate layout: each draft model loaded (draft, PARD) reserves a bundle with the draft's
    resources; the KV plan counts PARD's layers beside the target's and the draft's."""
    from specray.actors.config import SpecrayConfig
    from specray.cluster.placement import PlacementConfig, PlacementError, check_feasible, layout_for

    layout = layout_for(PlacementConfig(), ["draft", "pard"], cluster_gpus=2)
    assert layout.roles == {"target": [{"CPU": 0.5, "GPU": 1.0}], "draft": [{"CPU": 0.5, "GPU": 1.0}],
                            "pard": [{"CPU": 0.5, "GPU": 1.0}]}
    with pytest.raises(PlacementError, match="needs 3 GPU.*colocated"):
        check_feasible(layout, [{"CPU": 4, "GPU": 2}], 1)
    assert list(layout_for(PlacementConfig(mode="colocated"), ["draft", "pard"]).roles) == ["engine"]
    free_total = (2**31, 2**32)
    both = SpecrayConfig(target=tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])
    per_token = both.kv_plan(free_total=free_total).bytes_per_token  # target (2 layers) + draft (1)
    with_pard = both.model_copy(update={"checkpoints": {"pard": pard_dir}}).kv_plan(free_total=free_total)
    assert with_pard.bytes_per_token == per_token * 4 // 3  # + PARD (the tiny draft: 1 layer)


# -- entry points (HTTP, with PARD in a draft worker of its own drafting ahead: tests/test_serve.py's --
# main app, separate layout, overlap on; batch jobs: tests/test_jobs.py; the draft-ahead path:
# test_drafting_ahead_equals_drafting_afresh above) ---------------------------------------------------
def test_pard_from_the_command_line(tiny_pair, pard_dir, tmp_path, capsys):
    from specray.entrypoints.cli import main
    from tests.conftest import ALPHABET, save_char_tokenizer

    target_dir = tmp_path / "target"
    tiny_pair[0].save_pretrained(target_dir)
    save_char_tokenizer(target_dir)
    common = ["generate", "--prompt", "dbdbfjcg", "--target", str(target_dir), "--max-tokens", "12", "--json"]
    want = hf_greedy(tiny_pair[0], [ALPHABET.index(c) for c in "dbdbfjcg"], 12)
    assert main([*common, "--method", "draft", "--parallel-drafting", "--pard", pard_dir,
                 "--num-speculative-tokens", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["method"] == "pard" and got["metrics"]["num_drafts"] > 0
    assert main([*common, "--speculative-config", json.dumps({"method": "draft_model", "parallel_drafting": True,
                                                              "model": pard_dir})]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["method"] == "pard"
    assert main([*common, "--method", "pard"]) == 2
    assert "--method pard needs --pard DIR" in capsys.readouterr().err


# -- training ------------------------------------------------------------------------------------------
def test_cod_training_entries_equal_the_masks_drafted_at_inference(tiny_pair):
    """Each kept entry (j, t) of a COD sequence computes what the model computes at inference
    for the j-th mask after root x_{t-j}, with the whole prefix before it: the layout's mask and
    positions are exact."""
    from specray.training.pard import _additive, cod_mask, sequence_layout

    model = copy.deepcopy(tiny_pair[1]).eval()
    tokens = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(1))
    copy_ids, pos = sequence_layout(40, 14, 20, 5, 0.7, 0.3, torch.Generator().manual_seed(2))
    assert (copy_ids == 0).sum() == 40 and 40 < len(pos) < 40 + 4 * 20
    assert pos[copy_ids > 0].min() >= 15 and pos[copy_ids > 0].max() < 34  # masks in the window only
    seen = {(int(j), int(t)) for j, t in zip(copy_ids, pos)}
    assert all((j - 1, t - 1) in seen for j, t in seen if j > 1)  # COD: an entry's earlier masks are kept
    ids = torch.where(copy_ids == 0, tokens[pos], torch.full_like(pos, MASK))
    with torch.no_grad():
        trained = model(input_ids=ids[None], position_ids=pos[None],
                        attention_mask=_additive(cod_mask(copy_ids, pos))).logits[0]
        for n, (j, t) in enumerate(zip(copy_ids.tolist(), pos.tolist())):
            fed = torch.cat([tokens[: t - j + 1], torch.full((j,), MASK)])
            want = model(input_ids=fed[None]).logits[0, -1]
            torch.testing.assert_close(trained[n], want, atol=1e-4, rtol=1e-4)


def test_training_learns_and_saves_the_published_keys(tmp_path):
    """A short COD run on a tiny target's greedy continuations: the loss falls, the second
    position (the first mask) gets better, and the saved model is a PARD checkpoint that serves
    losslessly."""
    from specray.training import pard as T
    from tests.test_medusa import random_prompts

    target = tiny_llama(layers=2, seed=0)
    target.save_pretrained(tmp_path / "target")
    tiny_llama(layers=1, seed=1).save_pretrained(tmp_path / "draft")
    common = dict(batch_size=8, width=16, sequences=64, gen_len=24, copies=4, mask_token=MASK,
                  prompts=random_prompts)
    first = T.train_pard(str(tmp_path / "target"), str(tmp_path / "draft"), str(tmp_path / "p1"), steps=1, **common)
    last = T.train_pard(str(tmp_path / "target"), str(tmp_path / "draft"), str(tmp_path / "p2"), steps=120,
                        lr=1e-2, **common)
    assert last["final_loss"] < first["final_loss"] - 0.3, (first, last)
    acc = last["held_out_accuracy_per_position"]
    assert len(acc) == 4 and acc[1] > last["held_out_accuracy_per_position_before"][1], last
    raw = json.loads((tmp_path / "p2" / "config.json").read_text())
    assert raw["pard_token"] == MASK and raw["pard_max_tokens"] == 4 and raw["spd_type"] == "pard"
    engine = LLMEngine(EngineConfig(target="x", checkpoints={"pard": str(tmp_path / "p2")}, max_num_seqs=4),
                       target_model=copy.deepcopy(target))
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="pard", num_speculative_tokens=4))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    assert engine.totals.num_accepted_tokens > 0


def test_corpus_data_is_shared_through_the_disk_cache(tmp_path, monkeypatch):
    """``--data-cache DIR``: a second process (here: a cleared in-process cache) asking for the same
    corpus data reads it from disk instead of generating it again; other arguments, another file."""
    from specray.training import base

    made = []

    def fake(target, tokenizer, sequences, gen_len, seed, prompts, context):
        made.append(sequences)
        s = base.SequenceSet(torch.full((2, 3), sequences), torch.zeros(2, 3, 4), torch.tensor([3, 3]),
                             torch.tensor([1, 1]))
        return base.DistillData(s, s, torch.zeros(5, 4), torch.zeros(5, 4), 0.0)

    monkeypatch.setattr(base, "_distill_data", fake)
    target = tmp_path / "target"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"x")
    base.use_data_cache(str(tmp_path / "cache"))
    try:
        first = base.distill_data(str(target), None, 8, 4)
        base._DATA.clear()
        again = base.distill_data(str(target), None, 8, 4)
        other = base.distill_data(str(target), None, 16, 4)
    finally:
        base.use_data_cache(None)
        base._DATA.clear()
    assert made == [8, 16] and torch.equal(first.train.tokens, again.train.tokens)
    assert other.train.tokens[0, 0] == 16 and len(list((tmp_path / "cache").glob("distill-*.pt"))) == 2
