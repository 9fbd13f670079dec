"""DSpark: vLLM speculators' layout written by hand and loaded, lossless greedy (batch 1 and 8,
eager and static steps, every Markov variant, a reduced draft vocabulary), exact sampling, the
Markov head's effect on the draft (rank 0 drafts exactly as DFlash), the confidence head's
estimates on each draft row, the start-up header check and the refusal of other drafters'
weights, the block drafters through a coordinator's actors, and a short training run writing
the layout."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.base import PrefillRow, ProposalRow, SamplingView
from specray.policies.dflash import DFlashProposer
from specray.policies.dspark import DSparkDrafter, DSparkProposer
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import hf_greedy, tiny_llama
from tests.test_dflash import MASK, drafter_config, random_drafter, taps_after
from tests.test_engine import GREEDY, ragged_prompts

FIXED = dict(speculation_length=SpeculationLengthPolicy(), profile_costs=False)


def random_dspark(target, rank: int = 8, kind: str = "gated", block: int = 5, anchor: bool = True,
                  confidence: bool = True, seed: int = 0, std: float = 0.3, mask: int = MASK,
                  draft_vocab: int | None = None) -> DSparkDrafter:
    """Every weight random and non-zero; taps: the tiny 2-layer target's layer-0 output (enters layer 1)."""
    torch.manual_seed(seed)
    drafter = DSparkDrafter(drafter_config(target), (1, 1), mask, block, rank, kind, confidence,
                            confidence and rank > 0, anchor, draft_vocab)
    for name, p in drafter.named_parameters():
        torch.nn.init.normal_(p, std=std)
    if draft_vocab is not None:
        drafter.set_vocab(torch.arange(0, 2 * draft_vocab, 2))  # every other token
    return drafter.eval()


def write_published(drafter: DSparkDrafter, path, **config) -> None:
    """``drafter`` written by hand in speculators' layout (the keys vLLM's speculators write)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"], "speculators_version": "0.5.0",
           "transformer_layer_config": {
               "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
               "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
               "head_dim": c.head_dim, "num_hidden_layers": len(drafter.layers), "rms_norm_eps": c.rms_norm_eps,
               "rope_theta": 10000.0, "max_position_embeddings": c.max_position_embeddings,
               "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False},
           "draft_vocab_size": drafter.draft_vocab_size, "block_size": drafter.block_size,
           "aux_hidden_state_layer_ids": list(drafter.layer_ids), "mask_token_id": drafter.mask_token_id,
           "sample_from_anchor": drafter.first_draft == 0, "markov_rank": drafter.markov_rank,
           "markov_head_type": drafter.markov_head.kind if drafter.markov_head is not None else "vanilla",
           "enable_confidence_head": drafter.confidence_head is not None,
           "confidence_head_with_markov": drafter.confidence_with_markov,
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": drafter.max_drafts}],
                                  "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
           **config}
    (path / "config.json").write_text(json.dumps(cfg))
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(c.vocab_size, c.hidden_size)  # the target's, not read
    save_file(state, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def published(tiny_pair, tmp_path_factory):
    """A gated-Markov drafter with a confidence head, written in the layout, and the drafter."""
    path = tmp_path_factory.mktemp("dspark")
    drafter = random_dspark(tiny_pair[0])
    write_published(drafter, path)
    return str(path), drafter


def engine_with(target, checkpoint: str | None = None, drafter=None, max_num_seqs: int = 8, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs,
                                  checkpoints={"dspark": checkpoint} if checkpoint else {}, **{**FIXED, **kw}),
                     target_model=copy.deepcopy(target),
                     resources={"dspark": copy.deepcopy(drafter)} if drafter is not None else None)


# -- greedy: lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", ["eager", "static"])
def test_greedy_dspark_from_the_layout_equals_hf_generate_batch_8(tiny_pair, references, published, step):
    """Paged KV with prefix caching (the default): the second run's prompts start from cached
    blocks, the drafter's context of them included, and still equal HF's. (static: the drafts
    stay on the device until the step's read-back; the compiled modes run the same step, their
    compile costs more than this file's budget.)"""
    engine = engine_with(tiny_pair[0], published[0], step=step)
    for _ in range(2):
        outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="dspark", num_speculative_tokens=5))
        assert [o.token_ids for o in outs] == references
    assert engine.totals.num_drafts > 0 and engine.totals.num_draft_tokens > 4 * engine.totals.num_drafts
    assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0


def test_greedy_dspark_under_the_verification_budget(tiny_pair, references, published):
    """No k: the budget cuts each row's block after drafting by its confidences; still HF's tokens."""
    engine = engine_with(tiny_pair[0], published[0], speculation_length=None, profile_costs=False)
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="dspark"))
    assert [o.token_ids for o in outs] == references and engine.totals.num_drafts > 0


@pytest.mark.parametrize("kind,anchor,vocab", [("vanilla", False, None), ("rnn", True, 32)],
                         ids=["vanilla, block - 1 drafts", "rnn, reduced draft vocabulary"])
def test_greedy_dspark_batch_1_every_variant(tiny_pair, references, kind, anchor, vocab):
    target = tiny_pair[0]
    engine = engine_with(target, drafter=random_dspark(target, kind=kind, anchor=anchor, draft_vocab=vocab),
                         max_num_seqs=1)
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="dspark"))
    assert [o.token_ids for o in outs] == references[:3]


def test_greedy_dspark_at_tp2_equals_hf_generate(tiny_pair, references):
    """The target split over two thread ranks, the drafter beside rank 0 reading its taps."""
    from tests.test_tensor_parallel import thread_group

    target = tiny_pair[0]
    with thread_group(2) as runners:
        engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, tensor_parallel_size=2, **FIXED),
                           target_model=copy.deepcopy(target), resources={"dspark": random_dspark(target)},
                           runners=runners)
        outs = engine.generate(ragged_prompts(4), GREEDY, SpeculationParams(method="dspark", num_speculative_tokens=5))
    assert [o.token_ids for o in outs] == references[:4] and engine.totals.num_drafts > 0


# -- the heads on the draft --------------------------------------------------------------------------------
def proposer_for(target, drafter, tokens, slots=(0, 1)):
    from specray.engine.runner import ModelRunner

    cls = DSparkProposer if isinstance(drafter, DSparkDrafter) else DFlashProposer
    drafter = drafter.bind(target.model.embed_tokens, target.lm_head, 2)
    proposer = cls(drafter, ModelRunner(drafter, 2, 64), 64)
    taps = taps_after(target, tokens, drafter.target_layer_ids)
    for s in slots:
        proposer.prefill([PrefillRow(s, tokens[:20], tokens[20], taps[:20])])
    return proposer


def rows_of(tokens, k: int):
    sampled = SamplingView(temperature=0.8, top_k=20)
    return [ProposalRow(0, tokens[:21], k),
            ProposalRow(1, tokens[:21], k, sampled, torch.Generator().manual_seed(5))]


def test_rank_0_drafts_exactly_as_dflash_and_the_markov_head_changes_the_draft(tiny_pair):
    """The same backbone weights: without a Markov head DSpark's drafts (greedy and sampled,
    tokens and q) are DFlash's; with one they differ, and q is the biased distribution."""
    target = tiny_pair[0]
    tokens = torch.randint(0, 60, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    dflash = random_drafter(target, block=5)
    plain = DSparkDrafter(drafter_config(target), (1, 1), MASK, 5, sample_from_anchor=False)
    plain.load_state_dict(dflash.state_dict())
    want = proposer_for(target, dflash, tokens).propose(rows_of(tokens, 4))
    got = proposer_for(target, plain.eval(), tokens).propose(rows_of(tokens, 4))
    assert [r.tokens for r in got.rows] == [r.tokens for r in want.rows]
    torch.testing.assert_close(got.rows[1].probs, want.rows[1].probs, atol=0, rtol=0)

    markov = DSparkDrafter(drafter_config(target), (1, 1), MASK, 5, 8, "vanilla", sample_from_anchor=False)
    markov.load_state_dict(dflash.state_dict(), strict=False)
    torch.nn.init.normal_(markov.markov_head.markov_w1.weight, std=1.0)
    torch.nn.init.normal_(markov.markov_head.markov_w2.weight, std=1.0)
    biased = proposer_for(target, markov.eval(), tokens).propose(rows_of(tokens, 4))
    assert [r.tokens for r in biased.rows] != [r.tokens for r in want.rows]
    assert not torch.allclose(biased.rows[1].probs, want.rows[1].probs)
    q = biased.rows[1].probs
    assert torch.allclose(q.sum(-1), torch.ones(4)) and all(q[j, t] > 0 for j, t in enumerate(biased.rows[1].tokens))


def test_each_slots_bias_and_confidence_read_the_token_drafted_before_it(tiny_pair):
    """Greedy: position j's token is the argmax of the backbone's logits plus the bias from the
    token drafted at j - 1 (the root for the first), and its confidence reads that token and
    nothing of its own; every row carries one estimate in (0, 1) per draft, kept by ``cut``."""
    target = tiny_pair[0]
    tokens = torch.randint(0, 60, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter = random_dspark(target, kind="vanilla", block=5)
    proposer = proposer_for(target, drafter, tokens, slots=(0,))
    row = proposer.propose([ProposalRow(0, tokens[:21], 5)]).rows[0]
    assert len(row.confidence) == 5 and all(0 < c < 1 for c in row.confidence)
    assert row.cut(2).confidence == row.confidence[:2]
    fresh = proposer_for(target, drafter, tokens, slots=(0,))  # the backbone's output for the same block
    with torch.no_grad():
        _, out = fresh._run_block([ProposalRow(0, tokens[:21], 5)])
        prev = [tokens[20], *row.tokens[:-1]]
        emb = drafter.markov_head.markov_w1(torch.tensor(prev))
        logits = out.logits[0] + drafter.markov_head.markov_w2(emb)
        conf = torch.sigmoid(drafter.confidence_head(torch.cat([out.hidden[0], emb], -1)).squeeze(-1))
    assert logits.argmax(-1).tolist() == row.tokens
    torch.testing.assert_close(torch.tensor(row.confidence), conf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_the_training_forward_drafts_what_inference_drafts(tiny_pair, kind):
    """Teacher-forced with the drafted tokens as the previous ones, the training forward (every
    anchor's block at once, ``teacher_forced``) gives the same greedy tokens and confidences as
    the proposer's position-by-position walk."""
    target = tiny_pair[0]
    tokens = torch.randint(0, 60, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    drafter = random_dspark(target, kind=kind, block=5)
    row = proposer_for(target, drafter, tokens, slots=(0,)).propose([ProposalRow(0, tokens[:21], 5)]).rows[0]
    taps = taps_after(target, tokens, drafter.target_layer_ids)
    with torch.no_grad():
        hidden = drafter.blocks(taps[None], torch.tensor([tokens]), torch.tensor([[20]]))[0, 0]  # [block, H]
        logits, conf = drafter.teacher_forced(hidden, torch.tensor([tokens[20], *row.tokens[:-1]]))
    assert logits.argmax(-1).tolist() == row.tokens
    torch.testing.assert_close(torch.sigmoid(conf), torch.tensor(row.confidence), atol=1e-4, rtol=1e-4)


# -- sampling ---------------------------------------------------------------------------------------------
def test_sampling_keeps_the_target_distribution():
    """The Markov-biased distribution of each block position is q (static step: the device's
    acceptance): the first four tokens follow the target's exact distribution (chi-square, the
    harness of tests/test_sampling_e2e.py, fewer samples), and a biased copy fails the check."""
    from tests.test_sampling_e2e import PARAMS, PROMPT, VOCAB, check, exact_joint

    n = 1200
    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    drafter = random_dspark(target, kind="gated", block=3, std=0.5, mask=VOCAB - 1)
    engine = engine_with(target, drafter=drafter, max_num_seqs=128, step="static")
    params = [SamplingParams(seed=i, **PARAMS) for i in range(n)]
    outs = engine.generate([PROMPT] * n, params, SpeculationParams(method="dspark", num_speculative_tokens=3))
    t = engine.totals
    assert t.num_drafts > n // 2 and n // 10 < t.num_accepted_tokens < t.num_draft_tokens
    seqs, joint = np.array([o.token_ids for o in outs]), exact_joint(target)
    assert min(check(seqs, joint)) > 1e-3
    seqs[: n // 5, 1:] = seqs[: n // 5, :1]
    assert min(check(seqs, joint)) < 1e-3


# -- the layout, checked before anything starts ---------------------------------------------------------
def test_the_hand_written_layout_loads_tensor_for_tensor(published):
    path, drafter = published
    loaded = DSparkDrafter.load(path, hidden_size=32, num_layers=2)
    assert (loaded.block_size, loaded.max_drafts, loaded.layer_ids, loaded.markov_rank) == (5, 5, (1, 1), 8)
    assert loaded.markov_head.kind == "gated" and loaded.confidence_with_markov
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, drafter.state_dict()[k]), k


def test_bad_drafter_files_are_refused_before_anything_starts(tiny_pair, tiny_tok, tmp_path):
    from safetensors.torch import load_file, save_file

    from specray.engine.checkpoints import checkpoint_problems

    def problems(edit=None, drop=None, drafter=None) -> str:
        path = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        write_published(drafter or random_dspark(tiny_pair[0]), path)
        if edit:
            cfg = json.loads((path / "config.json").read_text())
            edit(cfg)
            (path / "config.json").write_text(json.dumps(cfg))
        if drop:
            state = load_file(str(path / "model.safetensors"))
            save_file({k: v for k, v in state.items() if drop not in k}, str(path / "model.safetensors"))
        found = checkpoint_problems(EngineConfig(target=tiny_tok["target"], tokenizer=tiny_tok["tokenizer"],
                                                 checkpoints={"dspark": str(path)}))
        return " | ".join(p.message for p in found)

    assert problems() == ""
    assert "not a DSpark drafter" in problems(lambda c: c.update(speculators_model_type="eagle3"))
    assert "markov_head_type" in problems(lambda c: c.update(markov_head_type="lstm"))
    assert "markov_head.gate_proj" in problems(drop="gate_proj")
    assert "confidence_head.proj" in problems(drop="confidence_head")
    assert "1..1" in problems(lambda c: c.update(aux_hidden_state_layer_ids=[0, 1]))
    assert "hidden size" in problems(lambda c: c["transformer_layer_config"].update(hidden_size=48))
    assert "target_hidden_size" in problems(lambda c: c.update(target_hidden_size=64))
    assert "mask token" in problems(lambda c: c.update(mask_token_id=99))
    assert "needs d2t" in problems(drop="d2t", drafter=random_dspark(tiny_pair[0], draft_vocab=32))
    # z-lab's spelling of the taps (the outputs of layer 0) reads as the same drafter
    assert problems(lambda c: c.update(target_layer_ids=[0, 0]) or c.pop("aux_hidden_state_layer_ids")) == ""


def test_other_drafters_weights_are_one_line_naming_the_flag(tiny_pair, tiny_tok, tmp_path, capsys, monkeypatch):
    """A DFlash drafter (no heads) and an EAGLE-3 head given as --dspark: exit 2 before Ray, one
    line naming the flag and what the directory holds."""
    import ray

    from specray.entrypoints.cli import main
    from tests.conftest import free_port
    from tests.test_eagle3 import random_head3

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    random_drafter(tiny_pair[0]).save(tmp_path / "dflash", num_target_layers=2)
    random_head3(tiny_pair[0]).save(tmp_path / "eagle3")
    model = ["--target", tiny_tok["target"], "--tokenizer", tiny_tok["tokenizer"], "--port", str(free_port())]
    for name, holds in (("dflash", "pass it with --dflash"), ("eagle3", "pass it with --eagle3")):
        assert main(["serve", *model, "--dspark", str(tmp_path / name)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and f"--dspark {tmp_path / name}: " in err[0], err
        assert "not a DSpark drafter" in err[0] and holds in err[0], err


def test_dspark_from_the_command_line(tiny_pair, tiny_tok, published, capsys):
    """``specray generate --dspark DIR`` (and vLLM's ``--speculative-config`` with a ``model``) in
    process; HTTP and batch jobs: tests/test_serve.py, tests/test_jobs.py."""
    from specray.entrypoints.cli import main
    from tests.conftest import ALPHABET

    common = ["generate", "--prompt", "dbdbfjcg", "--target", tiny_tok["target"], "--tokenizer",
              tiny_tok["tokenizer"], "--max-tokens", "12", "--json"]
    want = hf_greedy(tiny_pair[0], [ALPHABET.index(c) for c in "dbdbfjcg"], 12)
    assert main([*common, "--method", "dspark", "--dspark", published[0], "--num-speculative-tokens", "5"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["method"] == "dspark" and got["metrics"]["num_drafts"] > 0
    assert main([*common, "--speculative-config", json.dumps({"method": "dspark", "model": published[0]})]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main([*common, "--method", "dspark", "--num-speculative-tokens", "6", "--dspark", published[0]]) == 2
    assert "6 exceeds the 5 tokens a DSpark block of 5 drafts" in capsys.readouterr().err


def test_block_drafters_through_the_coordinator(tiny_coordinator, tiny_pair):
    """Actor handles: DSpark and DFlash beside the target in the separate layout's engine worker,
    ragged prompts in flight together, each request's own k or the budget's; greedy equals HF's."""
    import ray

    from tests.test_actors import GREEDY as GREEDY_DICT, PROMPTS

    specs = [{"method": "dspark", "num_speculative_tokens": 4}, {"method": "dflash", "num_speculative_tokens": 3},
             {"method": "dspark"}, {"method": "dflash"}]
    refs = [tiny_coordinator.generate.remote([p], GREEDY_DICT, s) for p, s in zip(PROMPTS, specs)]
    outs = [ray.get(r)[0] for r in refs]
    assert [o["token_ids"] for o in outs] == [hf_greedy(tiny_pair[0], p, GREEDY_DICT["max_tokens"])
                                              for p in PROMPTS[:len(specs)]]
    # An explicit k drafts every step; without one the verification budget decides (from step
    # costs measured on this machine), so only those rows' output is checked.
    assert all(o["metrics"]["num_drafts"] > 0 for o, s in zip(outs, specs) if "num_speculative_tokens" in s)


# -- training ---------------------------------------------------------------------------------------------
def test_training_writes_the_layout_that_serves(tmp_path):
    """A short run on a tiny 4-layer target: the loss falls, the report holds per-slot acceptance
    with and without the Markov head and the confidence head's estimates, and the saved layout
    loads and serves losslessly."""
    from specray.training import dspark as T
    from tests.test_medusa import random_prompts

    target = tiny_llama(layers=4, seed=0)
    target.save_pretrained(tmp_path / "target")
    report = T.train_dspark(str(tmp_path / "target"), str(tmp_path / "d"), steps=25, lr=1e-2, batch_size=4,
                            anchors=8, block=4, sequences=16, gen_len=12, mask_token=MASK, prompts=random_prompts,
                            markov_rank=8, markov_head_type="gated")
    assert report["final_loss"] < 1.9, report
    held = report["held_out"]
    assert len(held["markov"]["acceptance_per_slot"]) == 4 and len(held["markov"]["confidence_per_slot"]) == 4
    assert len(held["backbone"]["acceptance_per_slot"]) == 4
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["aux_hidden_state_layer_ids"] == [2, 2]
    engine = LLMEngine(EngineConfig(target="x", checkpoints={"dspark": str(tmp_path / "d")}, max_num_seqs=4, **FIXED),
                       target_model=copy.deepcopy(target))
    outs = engine.generate(ragged_prompts(2), GREEDY, SpeculationParams(method="dspark"))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(2)]


def test_the_benchs_slot_counts():
    """bench/calibration.py: a slot is reached when the ones before it were accepted; its estimate
    averages over the rows that reached it, and the reliability bins count every reached slot."""
    from types import SimpleNamespace

    from specray.bench.calibration import SlotLog

    log = SlotLog(SimpleNamespace(propose=None, propose_on_device=None, commit=None))
    log.rows = [((0.9, 0.5, 0.2), 3, 3), ((0.7, 0.3, 0.1), 3, 0), ((0.8, 0.6, 0.4), 3, 1)]
    assert log.per_position() == [
        {"position": 1, "reached": 3, "measured": 0.667, "predicted": 0.8},
        {"position": 2, "reached": 2, "measured": 0.5, "predicted": 0.55},
        {"position": 3, "reached": 1, "measured": 1.0, "predicted": 0.2}]
    assert sum(b["slots"] for b in log.reliability()) == 6
