"""Medusa: public head layout, lossless greedy on trees, exact tree sampling, typical acceptance."""

import copy
import json

import numpy as np
import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.kernels.tree import NAMED_TREES
from specray.policies.medusa import MedusaHeads, MedusaOptions
from tests.conftest import hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts


def random_heads(hidden=32, vocab=64, heads=4, layers=1, seed=0):
    torch.manual_seed(seed)
    h = MedusaHeads(hidden, vocab, heads, layers)
    for p in h.parameters():  # non-zero residual blocks too, so loading is really tested
        torch.nn.init.normal_(p, std=0.3)
    return h.eval()


def medusa_engine(target, heads, max_num_seqs=4):
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs), target_model=copy.deepcopy(target),
                     medusa_heads=heads)


def test_public_layout_round_trip(tmp_path):
    heads = random_heads()
    heads.save(tmp_path / "st")
    loaded = MedusaHeads.load(tmp_path / "st", hidden_size=32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(loaded(x), heads(x))
    # The original Medusa release: medusa_lm_head.pt, keys "{head}.{layer}.linear.weight" ...
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    torch.save(heads.heads.state_dict(), tmp_path / "pt" / "medusa_lm_head.pt")
    assert "0.0.linear.weight" in heads.heads.state_dict() and "0.1.weight" in heads.heads.state_dict()
    torch.testing.assert_close(MedusaHeads.load(tmp_path / "pt")(x), heads(x))


def test_bad_head_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        MedusaHeads.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    with pytest.raises(FileNotFoundError, match="medusa_lm_head"):
        MedusaHeads.load(tmp_path)
    torch.save({"0.1.weight": torch.zeros(64, 16)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="hidden size 16"):
        MedusaHeads.load(tmp_path, hidden_size=32)
    with pytest.raises(ValueError, match="does not match"):
        MedusaHeads.load(tmp_path)


@pytest.mark.parametrize("tree", list(NAMED_TREES))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_medusa_equals_hf_generate(tiny_pair, references, tree, batch):
    engine = medusa_engine(tiny_pair[0], random_heads(), max_num_seqs=batch)
    prompts = ragged_prompts(8 if batch > 1 else 3)
    outs = engine.generate(prompts, GREEDY, SpeculationParams(method="medusa", tree=tree))
    assert [o.token_ids for o in outs] == references[: len(prompts)]
    assert engine.totals.num_drafts > 0


def test_medusa_with_self_heads_accepts_and_stays_lossless(tiny_pair, references):
    """Heads that copy the target's own next-token head: head 0 often guesses right."""
    target = tiny_pair[0]
    heads = MedusaHeads(32, 64, 4, 1)
    for head in heads.heads:
        head[-1].weight.data.copy_(target.lm_head.weight.data)
    engine = medusa_engine(target, heads.eval())
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="medusa", medusa_choices=[[0], [1], [0, 0]]))
    assert [o.token_ids for o in outs] == references
    # Mixed with other methods in one batch.
    engine2 = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(target),
                        draft_model=copy.deepcopy(tiny_pair[1]), medusa_heads=heads.eval())
    specs = [SpeculationParams(method=m) for m in ["medusa", "draft", "ngram", "none"] * 2]
    assert [o.token_ids for o in engine2.generate(ragged_prompts(8), GREEDY, specs)] == references


def test_medusa_requests_are_validated(tiny_pair):
    engine = medusa_engine(tiny_pair[0], random_heads(heads=2))
    with pytest.raises(ValueError, match="exceeds the 2 draft heads"):
        engine.add_request([1, 2, 3], GREEDY, SpeculationParams(method="medusa", tree="trtllm_example"))
    engine.add_request([1, 2, 3], GREEDY, SpeculationParams(method="medusa"))  # default tree, cut to 2 heads
    assert engine.generate([[4, 5]], GREEDY, SpeculationParams(method="medusa"))[0].token_ids
    with pytest.raises(ValueError, match="listed twice"):
        SpeculationParams(method="medusa", medusa_choices=[[0], [0]])
    with pytest.raises(ValueError, match="unknown tree"):
        SpeculationParams(method="medusa", tree="bushy")
    plain = LLMEngine(EngineConfig(target="x"), target_model=copy.deepcopy(tiny_pair[0]))
    with pytest.raises(ValueError, match="needs Medusa heads"):
        plain.add_request([1, 2], GREEDY, SpeculationParams(method="medusa"))


def test_tree_sampling_keeps_the_target_distribution():
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, check, exact_joint

    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    engine = medusa_engine(target, random_heads(vocab=VOCAB, seed=5), max_num_seqs=64)
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    spec = SpeculationParams(method="medusa", medusa_choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    outs = engine.generate([PROMPT] * N, params, spec)
    t = engine.totals
    assert 0 < t.num_accepted_tokens and t.num_drafts > N // 2
    pvals = check(np.array([o.token_ids for o in outs]), exact_joint(target))
    assert min(pvals) > 1e-3, pvals


def test_typical_acceptance_runs_and_is_labelled_lossy(tiny_pair):
    engine = medusa_engine(tiny_pair[0], random_heads())
    spec = SpeculationParams(method="medusa", acceptance="typical", posterior_threshold=0.09, posterior_alpha=0.3)
    outs = engine.generate(ragged_prompts(4), SamplingParams(max_tokens=16, temperature=0.7, seed=1), spec)
    assert all(len(o.token_ids) == 16 for o in outs)
    assert "LOSSY" in MedusaOptions.model_fields["acceptance"].description


def random_prompts(split, n, seed):
    """A stand-in prompt source for the tiny target: random token ids, 8-20 long."""
    g = torch.Generator().manual_seed(seed + (1000 if split == "held_out" else 0))
    return [torch.randint(0, 64, (int(torch.randint(8, 21, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_training_lowers_the_loss_fits_a_tree_and_writes_the_public_layout(tmp_path):
    """Self-distillation on the tiny target's own greedy continuations."""
    from specray.training import medusa as T

    target = tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    common = dict(heads=2, batch_size=256, sequences=128, gen_len=32, tree_size=5, prompts=random_prompts)
    first = T.train_medusa(str(tmp_path / "target"), str(tmp_path / "h1"), steps=1, **common)
    last = T.train_medusa(str(tmp_path / "target"), str(tmp_path / "h2"), steps=150, lr=1e-2, **common)
    assert last["final_loss"] < first["final_loss"] - 0.5, (first, last)
    assert last["expected_accepted_length"] > first["expected_accepted_length"]  # on held-out prompts
    heads = MedusaHeads.load(tmp_path / "h2", hidden_size=32)
    assert heads.num_heads == 2 and json.loads((tmp_path / "h2" / "config.json").read_text())["medusa_num_layers"] == 1
    # The fitted tree is saved with the heads and becomes their default.
    assert heads.choices is not None and len(heads.choices) == last["tree_size"] <= 5
    assert 1.0 <= last["expected_accepted_length"] <= 3.0
    engine = medusa_engine(target, heads)
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="medusa"))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    t = engine.totals
    # Steps drafted the fitted tree (cut only in the last steps before max_tokens).
    assert len(t.accepted_per_pos) == len(heads.choices) and t.num_draft_tokens <= len(heads.choices) * t.num_drafts


def test_fit_tree_picks_the_most_often_right_paths():
    from specray.training.medusa import fit_tree

    # Per example, where head 0 / head 1 ranked the true next tokens (-1: not in the top k).
    ranks = torch.tensor([[0, 0], [0, 0], [0, 1], [1, 0], [2, -1], [-1, 0]])
    choices, expected = fit_tree(ranks, size=2, max_children=3)
    assert choices == [[0], [0, 0]] and expected == pytest.approx(1 + 3 / 6 + 2 / 6)
    choices, expected = fit_tree(ranks, size=10, max_children=3)  # every path seen at least once
    assert sorted(choices) == [[0], [0, 0], [0, 1], [1], [1, 0], [2]]
    assert expected == pytest.approx(1 + (3 + 2 + 1 + 1 + 1 + 1) / 6)
    assert all(c[:-1] in choices for c in choices if len(c) > 1)  # a valid tree: parents first


def test_heads_tree_in_config_is_validated(tmp_path):
    heads = random_heads(heads=2)
    heads.choices = [[0], [1], [0, 0]]
    heads.save(tmp_path)
    assert MedusaHeads.load(tmp_path).choices == [[0], [1], [0, 0]]
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["medusa_choices"] = [[0, 0, 0]]  # deeper than 2 heads
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bad medusa_choices"):
        MedusaHeads.load(tmp_path)


def test_trees_are_cut_to_the_room_a_step_has(tiny_pair):
    """Near the context limit, near max_tokens and under a speculation-length cap, the tree
    shrinks to fit instead of overflowing the KV cache; output stays the target's."""
    from specray.policies.spec_length import SpeculationLengthPolicy

    target = tiny_pair[0]
    heads = random_heads()
    wide = SpeculationParams(method="medusa", tree="wide")  # 13 candidates per step
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=2, max_model_len=20), target_model=copy.deepcopy(target),
                       medusa_heads=heads)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), wide)
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and len(p) + len(o.token_ids) == 20
        assert o.token_ids == hf_greedy(target, p, 20 - len(p))
    capped = LLMEngine(EngineConfig(target="x", max_num_seqs=2, speculation_length=SpeculationLengthPolicy(
        batch_k_caps=((1, 3),))), target_model=copy.deepcopy(target), medusa_heads=heads)
    outs = capped.generate(prompts, GREEDY, wide)
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    t = capped.totals
    assert 0 < t.num_drafts and t.num_draft_tokens <= 3 * t.num_drafts


def test_training_reports_measured_lengths_and_keeps_the_fit_only_if_it_wins(tmp_path, monkeypatch, capsys):
    """The report's accepted lengths are the engine's, the distillation shows progress, and a
    built-in tree that measures better than the fitted one becomes the heads' default."""
    from specray.training import medusa as T
    from specray.kernels.tree import NAMED_TREES

    target = tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    common = dict(heads=4, batch_size=256, sequences=64, gen_len=24, tree_size=5, prompts=random_prompts, steps=30,
                  measure_prompts=4, measure_tokens=16)
    report = T.train_medusa(str(tmp_path / "target"), str(tmp_path / "h"), **common)
    err = capsys.readouterr().err
    assert "generate:" in err and "64/64" in err and "target features" in err  # progress while distilling
    measured = report["mean_accepted_length"]
    assert set(measured) == {"fitted", *NAMED_TREES} and report["expected_accepted_length"] == measured[
        report["default_tree"]]
    assert report["default_tree"] == max(measured, key=lambda k: (measured[k], k != "fitted"))  # ties: built-in

    # A built-in tree that measures higher replaces the fit as the saved default.
    fake = {"fitted": 1.2, "chain": 1.5, "trtllm_example": 1.9, "wide": 1.4}
    monkeypatch.setattr(T, "measure_acceptance", lambda *a, **k: {
        name: {"mean_accepted_length": v, "acceptance": [round(v - 1, 3), 0.25]} for name, v in fake.items()})
    report = T.train_medusa(str(tmp_path / "target"), str(tmp_path / "h2"), **common)
    assert report["default_tree"] == "trtllm_example" and report["expected_accepted_length"] == 1.9
    saved = json.loads((tmp_path / "h2" / "config.json").read_text())
    assert saved["medusa_choices"] == NAMED_TREES["trtllm_example"]
    assert saved["specray_acceptance"] == [0.9, 0.25]  # the default's, for the self-tuning length to start from
    fake["fitted"] = 2.5  # and the fit is kept when it wins
    report = T.train_medusa(str(tmp_path / "target"), str(tmp_path / "h3"), **common)
    assert report["default_tree"] == "fitted" and MedusaHeads.load(tmp_path / "h3", hidden_size=32).choices != \
        NAMED_TREES["trtllm_example"]
