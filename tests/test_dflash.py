"""DFlash: z-lab's drafter layout (as vLLM and SGLang read it), the training forward over many
anchors equal to the block drafted at inference, lossless greedy (batch 1 and 8, ragged prompts,
mixed with other methods, eager and static steps, one host read per step), exact sampling, and
every entry point."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.base import PrefillRow, ProposalRow
from specray.policies.dflash import DFlashDrafter, DFlashProposer, default_layers
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts

MASK = 63


def drafter_config(target, layers: int = 2):
    from transformers import Qwen3Config

    c = target.config
    return Qwen3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=c.hidden_size // c.num_attention_heads, num_hidden_layers=layers,
                       vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings)


def random_drafter(target, taps=(0, 0), block: int = 6, seed: int = 0, std: float = 0.3, mask: int = MASK,
                   causal: bool = False) -> DFlashDrafter:
    """Every weight random and non-zero; the tiny 2-layer target has one tap (layer 0's output)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config(target), taps, mask_token_id=mask, block_size=block, causal=causal)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=std)
    return drafter.eval()


def dflash_engine(target, drafter, max_num_seqs=4, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, **kw), target_model=copy.deepcopy(target),
                     resources={"dflash": copy.deepcopy(drafter)})


def test_default_layers_follow_the_published_rule():
    assert default_layers(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B drafter
    assert default_layers(12, 1) == (6,) and default_layers(12, 3) == (1, 5, 9)


# -- greedy: lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_dflash_equals_hf_generate_batch_8(tiny_pair, references, step, k):
    target = tiny_pair[0]
    engine = dflash_engine(target, random_drafter(target), max_num_seqs=8, step=step,
                           speculation_length=SpeculationLengthPolicy())
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="dflash", num_speculative_tokens=k))
    assert [o.token_ids for o in outs] == references
    assert engine.totals.num_drafts > 0


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal block", "causal block"])
def test_greedy_dflash_batch_1_and_slot_reuse(tiny_pair, references, causal):
    target = tiny_pair[0]
    engine = dflash_engine(target, random_drafter(target, causal=causal), max_num_seqs=1)
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="dflash"))
    assert [o.token_ids for o in outs] == references


def test_dflash_mixes_with_other_methods_in_one_batch(tiny_pair, references):
    from tests.test_eagle3 import random_head3

    target, draft = tiny_pair
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(target),
                       draft_model=copy.deepcopy(draft),
                       resources={"dflash": random_drafter(target), "eagle3": random_head3(target)})
    specs = [SpeculationParams(method="dflash", num_speculative_tokens=4), SpeculationParams(method="draft"),
             SpeculationParams(method="eagle3", tree="chain"), SpeculationParams(method="none"),
             SpeculationParams(method="dflash")]
    outs = engine.generate(ragged_prompts(8), GREEDY, [specs[i % len(specs)] for i in range(8)])
    assert [o.token_ids for o in outs] == references


def test_static_step_reads_the_device_once(tiny_pair):
    from tests.test_static_step import reads_per_step

    target = tiny_pair[0]
    engine = dflash_engine(target, random_drafter(target), step="static", speculation_length=SpeculationLengthPolicy())
    for p in ragged_prompts(4):
        engine.add_request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                           SpeculationParams(method="dflash", num_speculative_tokens=4))
    reads = reads_per_step(engine)
    assert len(reads) >= 3 and max(reads) == 1, reads


def test_a_block_longer_than_trained_is_refused(tiny_pair):
    target = tiny_pair[0]
    engine = dflash_engine(target, random_drafter(target, block=4))
    with pytest.raises(ValueError, match="block of 4"):
        engine.add_request([1, 2, 3], GREEDY, SpeculationParams(method="dflash", num_speculative_tokens=4))
    outs = engine.generate(ragged_prompts(2), GREEDY, SpeculationParams(method="dflash"))  # self-tuned: <= 3
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(2)]
    assert engine.totals.num_draft_tokens <= 3 * engine.totals.num_drafts


# -- the drafter: inference equals training --------------------------------------------------------------
def taps_after(target, tokens: list[int], layer_ids) -> torch.Tensor:
    """[len(tokens), n H]: the target's hidden states after ``layer_ids`` (HF hidden_states[id + 1])."""
    from tests.test_eagle3 import taps_of

    return taps_of(target, tokens, [k + 1 for k in layer_ids])


def test_blocks_drafted_at_inference_equal_the_training_forward(tiny_pair):
    """Each anchor's block in the training forward (many blocks over one sequence, under the
    block mask) equals the block the proposer drafts from that anchor's context through the
    runner's slot cache (context columns kept, block columns discarded)."""
    from specray.engine.runner import ModelRunner

    target = tiny_pair[0]
    drafter = random_drafter(target, block=5).bind(target.model.embed_tokens, target.lm_head, 2)
    tokens = torch.randint(0, 60, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    taps = taps_after(target, tokens, drafter.target_layer_ids)
    anchors = torch.tensor([[4, 11, 12, 20, 25]])
    with torch.no_grad():
        trained = target.lm_head(drafter.blocks(taps[None], torch.tensor([tokens]), anchors))[0]  # [A, block, V]
    runner = ModelRunner(drafter, 2, 64)
    proposer = DFlashProposer(drafter, runner, 64)
    for n, a in enumerate(anchors[0].tolist()):
        proposer.prefill([PrefillRow(n % 2, tokens[:a], tokens[a], taps[:a])])  # the root is token a
        block = torch.full((1, 5), MASK)
        block[0, 0] = tokens[a]
        context = drafter.context(taps[:a])
        with torch.no_grad():
            logits = proposer._forward([n % 2], [context], drafter.noise(block))[0]  # [block - 1, V]
        proposer._pending.pop(n % 2)
        torch.testing.assert_close(logits, trained[n, 1:], atol=1e-4, rtol=1e-4)
        assert runner.lengths[n % 2] == a  # the context cached, the block not


def test_context_fed_in_pieces_equals_fed_at_once(tiny_pair):
    """A long context caught up in a forward of its own, then blocks over growing contexts: the
    same drafts as one forward with the whole context."""
    from specray.engine.runner import ModelRunner

    target = tiny_pair[0]
    drafter = random_drafter(target).bind(target.model.embed_tokens, target.lm_head, 2)
    tokens = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    taps = taps_after(target, tokens, drafter.target_layer_ids)
    proposer = DFlashProposer(drafter, ModelRunner(drafter, 2, 64), 64)
    proposer.prefill([PrefillRow(0, tokens[:30], tokens[30], taps[:30])])
    row = lambda n: ProposalRow(0, tokens[: n + 1], 5)  # noqa: E731
    first = proposer.propose([row(30)]).rows[0].tokens
    proposer.commit([type("C", (), {"slot": 0, "features": taps[30:36]})()])  # six more positions committed
    later = proposer.propose([row(36)]).rows[0].tokens
    fresh = DFlashProposer(drafter, ModelRunner(drafter, 2, 64), 64)
    fresh.prefill([PrefillRow(1, tokens[:36], tokens[36], taps[:36])])
    assert fresh.propose([ProposalRow(1, tokens[:37], 5)]).rows[0].tokens == later and len(first) == 5


def test_a_cached_prefix_drafts_as_a_fresh_one(tiny_pair):
    """Paged KV with prefix caching: a prompt whose blocks are cached starts from the drafter's
    cached context of them (the target's taps begin after the prefix); its drafts equal those
    the same prompt got when nothing was cached."""
    target = tiny_pair[0]
    engine = dflash_engine(target, random_drafter(target), max_num_seqs=2)
    drafts = []
    propose = engine.proposers.get("dflash").propose
    engine.proposers.get("dflash").propose = lambda rows: drafts.append(propose(rows)) or drafts[-1]
    prompts = [[(5 * i + 3) % 60 for i in range(40)], [(7 * i + 1) % 60 for i in range(37)]]
    runs = []
    for _ in range(2):
        drafts.clear()
        outs = engine.generate(prompts, GREEDY, SpeculationParams(method="dflash", num_speculative_tokens=5))
        runs.append([[row.tokens for row in d.rows] for d in drafts])
        assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    assert sum(o.metrics["num_cached_tokens"] for o in outs) >= 64  # the second run's prompts hit the cache
    assert runs[0] == runs[1] and runs[0]


# -- sampling ---------------------------------------------------------------------------------------------
def test_sampling_keeps_the_target_distribution():
    """Each block position carries the drafter's distribution as q (through the device acceptance
    of the static step; the host's rule is the draft model's, tests/test_sampling_e2e.py)."""
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, assert_follows

    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    drafter = random_drafter(target, block=4, std=0.5, mask=VOCAB - 1)
    engine = dflash_engine(target, drafter, max_num_seqs=64, step="static", speculation_length=SpeculationLengthPolicy())
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params, SpeculationParams(method="dflash", num_speculative_tokens=3))
    t = engine.totals
    assert t.num_drafts > N // 2 and N // 10 < t.num_accepted_tokens < t.num_draft_tokens
    assert_follows(np.array([o.token_ids for o in outs]), target)


# -- training and the published layout ----------------------------------------------------------------------
def test_training_learns_and_saves_the_published_layout(tmp_path):
    """A short run on a tiny 6-layer target (taps after layers 1 and 3): the loss falls, the
    held-out first block positions get better, the drafter is saved in z-lab's layout and
    serves losslessly."""
    from safetensors.torch import load_file

    from specray.training import dflash as T
    from tests.test_medusa import random_prompts

    target = tiny_llama(layers=6, seed=0)
    target.save_pretrained(tmp_path / "target")
    common = dict(batch_size=8, anchors=8, block=4, sequences=64, gen_len=24, mask_token=MASK, prompts=random_prompts)
    first = T.train_dflash(str(tmp_path / "target"), str(tmp_path / "d1"), steps=1, **common)
    last = T.train_dflash(str(tmp_path / "target"), str(tmp_path / "d2"), steps=150, lr=1e-2, **common)
    assert last["final_loss"] < first["final_loss"] - 0.3, (first, last)
    assert last["held_out"]["accuracy_per_position"][0] > last["held_out_before"]["accuracy_per_position"][0], last
    assert last["target_layer_ids"] == [1, 3]
    raw = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3], "block_size": 4}
    names = set(load_file(str(tmp_path / "d2" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= names and not any("embed" in n or "lm_head" in n for n in names)
    engine = LLMEngine(EngineConfig(target="x", checkpoints={"dflash": str(tmp_path / "d2")}, max_num_seqs=4),
                       target_model=copy.deepcopy(target))
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="dflash", num_speculative_tokens=3))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    assert engine.totals.num_accepted_tokens > 0


def published_checkpoint(target, path, **options) -> dict:
    """A drafter written by hand in z-lab's layout (names and config keys as vLLM and SGLang read
    them), from a random drafter's tensors; returns them."""
    from safetensors.torch import save_file

    drafter = random_drafter(target, **options)
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": 64,
           "num_target_layers": 2, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
           "block_size": drafter.block_size,
           "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": list(drafter.target_layer_ids)}}
    (path / "config.json").write_text(json.dumps(cfg))
    shipped = {f"model.{k}": v for k, v in state.items()}  # some trainers save under model.
    shipped["embed_tokens.weight"] = torch.zeros(64, 32)  # the target's, not read
    save_file(shipped, str(path / "model.safetensors"))
    return state


def test_a_hand_written_published_checkpoint_loads_and_serves(tiny_pair, tmp_path):
    target = tiny_pair[0]
    state = published_checkpoint(target, tmp_path / "d")
    loaded = DFlashDrafter.load(tmp_path / "d", hidden_size=32, num_layers=2)
    assert loaded.block_size == 6 and loaded.mask_token_id == MASK and loaded.layer_ids == (1, 1)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, state[k])
    engine = LLMEngine(EngineConfig(target="x", checkpoints={"dflash": str(tmp_path / "d")}, max_num_seqs=2),
                       target_model=copy.deepcopy(target))
    outs = engine.generate(ragged_prompts(2), GREEDY, SpeculationParams(method="dflash"))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(2)]
    saved = tmp_path / "saved"  # and specray's own save reads back the same
    loaded.save(saved, num_target_layers=2)
    again = DFlashDrafter.load(saved, hidden_size=32, num_layers=2)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in again.state_dict().items())


def test_bad_drafter_files_are_refused_before_anything_starts(tiny_pair, tmp_path):
    from specray.engine.checkpoints import checkpoint_problems

    target = tiny_pair[0]
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)

    def problems(edit=None, drop=None) -> str:
        path = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        published_checkpoint(target, path)
        if edit:
            cfg = json.loads((path / "config.json").read_text())
            edit(cfg)
            (path / "config.json").write_text(json.dumps(cfg))
        if drop:
            from safetensors.torch import load_file, save_file

            state = load_file(str(path / "model.safetensors"))
            save_file({k: v for k, v in state.items() if drop not in k}, str(path / "model.safetensors"))
        found = checkpoint_problems(EngineConfig(target=str(target_dir), checkpoints={"dflash": str(path)}))
        return " | ".join(p.message for p in found)

    assert problems() == ""
    assert "DFlash-2" in problems(lambda c: c.update(architectures=["DFlash2DraftModel"]))
    assert "sliding-window" in problems(lambda c: c.update(layer_types=["sliding_attention"] * 2))
    assert "target_layer_ids" in problems(lambda c: c["dflash_config"].pop("target_layer_ids"))
    assert "last" in problems(lambda c: c["dflash_config"].update(target_layer_ids=[0, 1]))
    assert "hidden size" in problems(lambda c: c.update(hidden_size=48))
    assert "mask token" in problems(lambda c: c["dflash_config"].update(mask_token_id=99))
    assert "k_norm" in problems(drop="k_norm")


# -- every entry point ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter_dir(tiny_pair, tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash")
    random_drafter(tiny_pair[0]).save(path, num_target_layers=2)
    return str(path)


def test_dflash_from_the_command_line(tiny_pair, drafter_dir, tmp_path, capsys):
    """(HTTP, separate layout: tests/test_serve.py's main app; batch jobs: tests/test_jobs.py.)"""
    from specray.entrypoints.cli import main
    from tests.conftest import ALPHABET, save_char_tokenizer

    target_dir = tmp_path / "target"
    tiny_pair[0].save_pretrained(target_dir)
    save_char_tokenizer(target_dir)
    common = ["generate", "--prompt", "dbdbfjcg", "--target", str(target_dir), "--max-tokens", "12", "--json"]
    want = hf_greedy(tiny_pair[0], [ALPHABET.index(c) for c in "dbdbfjcg"], 12)
    assert main([*common, "--method", "dflash", "--dflash", drafter_dir, "--num-speculative-tokens", "4"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["method"] == "dflash" and got["metrics"]["num_drafts"] > 0
    assert main([*common, "--speculative-config", json.dumps({"method": "dflash", "model": drafter_dir})]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main([*common, "--method", "dflash"]) == 2
    assert "--method dflash needs --dflash DIR" in capsys.readouterr().err
