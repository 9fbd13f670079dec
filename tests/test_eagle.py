"""EAGLE-1/EAGLE-2: public head layout, lossless greedy on static and dynamic trees, exact
tree sampling, the head's cache, training, and the coordinator."""

import copy
import json

import numpy as np
import pytest
import ray
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.eagle import EAGLE_TREES, EagleHead
from tests.conftest import hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts


def head_config(target):
    from transformers import LlamaConfig

    c = target.config
    return LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size, num_hidden_layers=1)


def random_head(target, seed=0, std=0.3):
    torch.manual_seed(seed)
    head = EagleHead(head_config(target))
    for p in head.parameters():  # every weight non-zero, so loading is really tested
        torch.nn.init.normal_(p, std=std)
    return head.eval()


def self_head(target):
    """A head that copies the target's last layer and reads its features directly: fc passes
    the feature half through, so it often drafts what the target would."""
    head = random_head(target, std=0.0)
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.fc.bias.zero_()
    return head


def eagle_engine(target, head, max_num_seqs=4, **kw):
    """An engine serving ``head`` under the verification budget, its cost table left to fill from
    the steps it serves (so a random head drafts in its first steps, and identity is tested)."""
    kw.setdefault("profile_costs", False)
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, **kw), target_model=copy.deepcopy(target),
                     resources={"eagle": copy.deepcopy(head)})


SPECS = {
    "eagle-1 default tree": {},
    "eagle-1 chain": {"tree": "chain"},
    "eagle-1 explicit": {"eagle_choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]},
    "eagle-2": {"dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12},
    "eagle-2 wide": {"dynamic_tree": True, "top_k": 8, "depth": 6, "total_tokens": 40},
    "eagle-2 sharpened confidence": {"dynamic_tree": True, "top_k": 4, "depth": 5, "total_tokens": 16},
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_eagle_equals_hf_generate(target, references, name, batch):
    head = random_head(target)
    if "sharpened" in name:
        head.greedy_temperature = 0.3  # what training fits (greedy rows' EAGLE-2 confidence)
    engine = eagle_engine(target, head, max_num_seqs=batch)
    prompts = ragged_prompts(8 if batch > 1 else 3)  # 8 prompts on 4 slots: requests join mid-run
    outs = engine.generate(prompts, GREEDY, SpeculationParams(method="eagle", **SPECS[name]))
    assert [o.token_ids for o in outs] == references[: len(prompts)]
    assert engine.totals.num_drafts > 0


def test_a_good_head_is_accepted_and_mixes_with_other_methods(tiny_pair, references):
    target, draft = tiny_pair
    head = self_head(target)
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(target),
                       draft_model=copy.deepcopy(draft), resources={"eagle": head})
    specs = [SpeculationParams(method="eagle", dynamic_tree=i % 2 == 0) if i % 4 < 2 else
             SpeculationParams(method=["draft", "ngram"][i % 2]) for i in range(8)]
    outs = engine.generate(ragged_prompts(8), GREEDY, specs)
    assert [o.token_ids for o in outs] == references
    eagle = [o.metrics for o, s in zip(outs, specs) if s.method == "eagle"]
    assert sum(m["num_accepted_tokens"] for m in eagle) > 0


def test_the_heads_cache_equals_recomputing_it(target):
    """After several steps, each slot's head KV equals a fresh head run over the committed
    pairs built from the target's true features."""
    engine = eagle_engine(target, random_head(target), max_num_seqs=2)
    prompts = [ragged_prompts(2)[0], ragged_prompts(2)[1]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                              SpeculationParams(method="eagle", dynamic_tree=True, top_k=3, depth=3, total_tokens=8))
           for p in prompts]
    for _ in range(4):
        engine.step()
    proposer = engine.proposers.get("eagle")
    runner = proposer.runner
    for rid in ids:
        req = engine.scheduler.find(rid)
        n = runner.lengths[req.slot]
        assert n > len(req.prompt_ids)
        seq = req.token_ids  # pairs (f_t, x_{t+1}) for t < n
        with torch.no_grad():
            feats = target.model(torch.tensor([seq[:n]])).last_hidden_state[0]
        fresh = copy.deepcopy(runner)
        fresh.reset(req.slot)
        head = proposer.head
        fresh.forward([req.slot], [seq[1 : n + 1]], embeds=[head.fuse(torch.tensor(seq[1 : n + 1]), feats)])
        for layer in range(len(runner.cache.keys)):
            torch.testing.assert_close(runner.cache.keys[layer][req.slot, :, :n], fresh.cache.keys[layer][req.slot, :, :n],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(runner.cache.values[layer][req.slot, :, :n],
                                       fresh.cache.values[layer][req.slot, :, :n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", [{"eagle_choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
                                  {"dynamic_tree": True, "top_k": 3, "depth": 3, "total_tokens": 8}],
                         ids=["eagle-1 sampled nodes", "eagle-2 deterministic nodes"])
def test_tree_sampling_keeps_the_target_distribution(spec):
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, check, exact_joint

    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    engine = eagle_engine(target, self_head(target), max_num_seqs=64)
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params, SpeculationParams(method="eagle", **spec))
    t = engine.totals
    assert t.num_drafts > N // 2 and 0 < t.num_accepted_tokens
    seqs = np.array([o.token_ids for o in outs])
    assert min(check(seqs, exact_joint(target))) > 1e-3
    biased = seqs.copy()  # negative control: the same test catches a plausible bug
    biased[: N // 5, 1:] = biased[: N // 5, :1]
    assert min(check(biased, exact_joint(target))) < 1e-3


def test_public_layout_round_trip(target, tmp_path):
    head = random_head(target).bind(target.model.embed_tokens, target.lm_head)
    head.choices = [[0], [1], [0, 0]]
    head.greedy_temperature = 0.35
    head.save(tmp_path / "st")
    loaded = EagleHead.load(tmp_path / "st", hidden_size=32).bind(target.model.embed_tokens, target.lm_head)
    assert loaded.choices == [[0], [1], [0, 0]] and loaded.greedy_temperature == 0.35
    toks, feats = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_sequence(toks, feats), head.forward_sequence(toks, feats))
    # SafeAILab/EAGLE's own files: pytorch_model.bin with embed_tokens and "bias" in config.json
    (tmp_path / "pt").mkdir()
    cfg = head_config(target).to_dict()
    cfg.update({"bias": True, "architectures": ["LlamaForCausalLM"]})
    (tmp_path / "pt" / "config.json").write_text(json.dumps(cfg, default=str))
    state = {**head.state_dict(), "embed_tokens.weight": target.model.embed_tokens.weight.detach()}
    assert "fc.bias" in state and "layers.0.self_attn.q_proj.weight" in state
    assert "layers.0.input_layernorm.weight" not in state  # EAGLE's layer has no input norm
    torch.save(state, tmp_path / "pt" / "pytorch_model.bin")
    other = EagleHead.load(tmp_path / "pt").bind(target.model.embed_tokens, target.lm_head)
    assert other.greedy_temperature == 1.0  # public heads: EAGLE-2's raw probabilities
    with torch.no_grad():
        torch.testing.assert_close(other.forward_sequence(toks, feats), head.forward_sequence(toks, feats))


def test_bad_head_files_raise(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        EagleHead.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        EagleHead.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(ValueError, match="lacks"):
        EagleHead.load(tmp_path)
    cfg = head_config(target).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        EagleHead.load(tmp_path)
    with pytest.raises(ValueError, match="hidden size 32"):
        EagleHead.load(tmp_path, hidden_size=64)
    torch.save({"fc.weight": torch.zeros(32, 64)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="does not match"):
        EagleHead.load(tmp_path)
    random_head(target).save(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["eagle_choices"] = [[0], [0]]
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bad eagle_choices"):
        EagleHead.load(tmp_path / "ok")
    cfg["eagle_choices"], cfg["greedy_temperature"] = None, -1
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="greedy_temperature must be a positive number"):
        EagleHead.load(tmp_path / "ok")


def test_eagle_requests_are_validated(target):
    with pytest.raises(ValueError, match="dynamic_tree builds its own tree"):
        SpeculationParams(method="eagle", dynamic_tree=True, tree="chain")
    with pytest.raises(ValueError, match="unknown tree"):
        SpeculationParams(method="eagle", tree="bushy")
    with pytest.raises(ValueError, match="top_k"):
        SpeculationParams(method="eagle", top_k=0)
    assert "mc_sim_7b_63" in EAGLE_TREES
    engine = eagle_engine(target, random_head(target), max_model_len=16)
    with pytest.raises(ValueError, match="total_tokens"):
        engine.add_request([1, 2], GREEDY, SpeculationParams(method="eagle", dynamic_tree=True, total_tokens=40))
    plain = LLMEngine(EngineConfig(target="x"), target_model=copy.deepcopy(target))
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        plain.add_request([1, 2], GREEDY, SpeculationParams(method="eagle"))


def test_trees_are_cut_to_the_room_a_step_has(target):
    engine = eagle_engine(target, random_head(target), max_num_seqs=2, max_model_len=20)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]
    for spec in ({}, {"dynamic_tree": True, "total_tokens": 18, "depth": 8}):
        outs = engine.generate(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                               SpeculationParams(method="eagle", **spec))
        for p, o in zip(prompts, outs):
            assert o.finish_reason == "length" and len(p) + len(o.token_ids) == 20
            assert o.token_ids == hf_greedy(target, p, 20 - len(p))


def test_a_capped_tree_keeps_its_best_nodes(tiny_pair, references):
    """Under a cap below its size (the self-tuning length at a large batch), a greedy row's
    static tree keeps the head's likeliest nodes, not its first level's siblings: capped at
    3, this wide tree (3 siblings listed first) still reaches depth 3 along its best path."""
    from specray.policies.spec_length import SpeculationLengthPolicy

    target, _ = tiny_pair
    engine = eagle_engine(target, self_head(target), speculation_length=SpeculationLengthPolicy(batch_k_caps=((1, 3),)))
    tree = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="eagle", eagle_choices=tree))
    assert [o.token_ids for o in outs] == references
    per_pos = np.sum([o.metrics["accepted_per_pos"] + [0] * 3 for o in outs if o.metrics["accepted_per_pos"]], axis=0)
    assert per_pos[2] > 0, per_pos  # a first-3-nodes cut ([0], [1], [2]) never accepts past position 1


def test_a_capped_dynamic_tree_grows_only_what_its_cap_can_keep(tiny_pair, references, monkeypatch):
    """EAGLE-2 under a cap below top_k (the self-tuning length, or the tokens left) expands and
    proposes only cap-many nodes per level: it drafts exactly the tree full-width growth cut to
    the cap drafts (each kept node's ancestors are kept, so each is among its level's best),
    feeding the head fewer nodes."""
    from specray.policies import eagle
    from specray.policies.spec_length import SpeculationLengthPolicy

    target, _ = tiny_pair
    spec = SpeculationParams(method="eagle", dynamic_tree=True, top_k=6, depth=4, total_tokens=20)
    real_init, real_finish, real_expand = eagle._RowPlan.__init__, eagle.EagleProposer._finish, eagle.EagleProposer._expand

    def run(full_width: bool):
        drafts, fed = [], []

        def init(self, *args):
            real_init(self, *args)
            if full_width:  # as before: every level top_k wide whatever the budget
                self.width = self.row.options.top_k

        def finish(self, plan):
            row = real_finish(self, plan)
            drafts.append((list(row.tokens), row.tree.parents.tolist()))
            return row

        def expand(self, plans):
            fed.append(sum(len({a for n in p.frontier for a in self._ancestors(p, n)}) for p in plans))
            return real_expand(self, plans)

        monkeypatch.setattr(eagle._RowPlan, "__init__", init)
        monkeypatch.setattr(eagle.EagleProposer, "_finish", finish)
        monkeypatch.setattr(eagle.EagleProposer, "_expand", expand)
        engine = eagle_engine(target, self_head(target), speculation_length=SpeculationLengthPolicy(batch_k_caps=((1, 3),)))
        outs = engine.generate(ragged_prompts(8), GREEDY, spec)
        assert [o.token_ids for o in outs] == references
        return drafts, sum(fed)

    (narrow, fed_narrow), (wide, fed_wide) = run(False), run(True)
    assert narrow == wide and any(len(t) == 3 for t, _ in narrow)
    assert fed_narrow < 0.6 * fed_wide, (fed_narrow, fed_wide)  # 3 of 6 nodes a level, and their ancestors


@pytest.mark.parametrize("step", ["eager", "static"])
def test_a_batch_draft_that_raises_is_retried_row_by_row(tiny_pair, references, monkeypatch, step):
    """A head that fails once on a whole batch (after its catch-up) costs that step's drafts,
    not the requests: the executor drafts each row alone, which finds the rows as they were."""
    from specray.policies import eagle, eagle_device

    target, _ = tiny_pair
    failed = []

    def fail_once(real):
        def wrapper(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise RuntimeError("a transient fault")
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(eagle.EagleProposer, "_finish", fail_once(eagle.EagleProposer._finish))
    monkeypatch.setattr(eagle_device, "grow_static", fail_once(eagle_device.grow_static))
    engine = eagle_engine(target, self_head(target), step=step)
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="eagle"))
    assert failed and [o.token_ids for o in outs] == references
    assert all(o.finish_reason == "length" for o in outs)
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_training_learns_and_saves_the_public_layout(tmp_path):
    """A short self-distillation on the tiny target: the loss falls, the held-out depth-1
    accuracy beats an untrained head, the fitted tree is saved and serves losslessly."""
    from specray.training import eagle as T
    from tests.test_medusa import random_prompts

    target = tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    common = dict(batch_size=8, width=32, sequences=96, gen_len=24, tree_size=6, depth=3, prompts=random_prompts)
    first = T.train_eagle(str(tmp_path / "target"), str(tmp_path / "h1"), steps=1, **common)
    last = T.train_eagle(str(tmp_path / "target"), str(tmp_path / "h2"), steps=150, lr=1e-2, **common)
    assert last["final_loss"] < first["final_loss"] - 0.5, (first, last)
    assert last["held_out_top1_per_depth"][0] > first["held_out_top1_per_depth"][0] + 0.1  # a random target: hard
    head = EagleHead.load(tmp_path / "h2", hidden_size=32)
    assert head.choices is not None and len(head.choices) == last["tree_size"] <= 6
    assert head.greedy_temperature == last["greedy_temperature"] and 0.1 <= head.greedy_temperature < 3
    engine = eagle_engine(target, head)
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="eagle"))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    assert engine.totals.num_accepted_tokens > 0


def test_eagle_through_the_coordinator(tiny_coordinator, tiny_pair):
    """The separate layout (colocated: test_colocated_tp2_every_method, the engine tests)."""
    from tests.test_actors import GREEDY as GREEDY_DICT, PROMPTS

    target, c = tiny_pair[0], tiny_coordinator
    specs = [{"method": "eagle", "dynamic_tree": i % 2 == 1} for i in range(len(PROMPTS))]
    refs = [c.generate.remote([p], GREEDY_DICT, s) for p, s in zip(PROMPTS, specs)]
    outs = [ray.get(r)[0] for r in refs]
    assert [o["token_ids"] for o in outs] == [hf_greedy(target, p, GREEDY_DICT["max_tokens"]) for p in PROMPTS]
    assert sum(o["metrics"]["num_drafts"] for o in outs) > 0
    with pytest.raises(ValueError, match="dynamic_tree"):
        ray.get(c.generate.remote([[1, 2]], GREEDY_DICT, {"method": "eagle", "dynamic_tree": True, "tree": "chain"}))
