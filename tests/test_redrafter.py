"""ReDrafter: Apple's checkpoint layout, beam search, beams packed into a tree, lossless greedy
and sampling, training, and every entry point (engine, coordinator, jobs, HTTP, CLI; the batch
job that runs ReDrafter: tests/test_batch_methods.py)."""

import copy
import json

import httpx
import numpy as np
import pytest
import ray
import torch
import torch.nn.functional as F

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.runner import ModelRunner
from specray.kernels.tree import TokenTree
from specray.policies.base import CommitRow, PrefillRow, ProposalRow
from specray.policies.redrafter import Drafter, ReDrafterOptions, ReDrafterProposer, pack_beams
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts


def random_drafter(hidden=32, vocab=64, layers=2, exit_dim=None, rnn=True, seed=0, std=0.3):
    torch.manual_seed(seed)
    d = Drafter(hidden, vocab, exit_dim, layers, rnn)
    for p in d.parameters():  # every weight non-zero, so loading is really tested
        torch.nn.init.normal_(p, std=std)
    return d.eval()


def redrafter_engine(target, drafter, max_num_seqs=4, **kw):
    """Static speculation length (no caps): every row drafts, whatever the self-tuning
    controller would decide from this machine's timings, so acceptance counts are stable."""
    kw.setdefault("speculation_length", SpeculationLengthPolicy())
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, **kw), target_model=copy.deepcopy(target),
                     resources={"redrafter": copy.deepcopy(drafter)})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_checkpoints):
    """A drafter self-distilled on the tiny target (and a 1-step one to compare with)."""
    from specray.training import redrafter as T
    from tests.test_medusa import random_prompts

    root = tmp_path_factory.mktemp("redrafter")
    common = dict(batch_size=256, length=4, sequences=384, gen_len=32, prompts=random_prompts,
                  shapes=((1, 3), (4, 3)))
    first = T.train_redrafter(tiny_checkpoints["target"], str(root / "d1"), steps=1, **common)
    last = T.train_redrafter(tiny_checkpoints["target"], str(root / "d2"), steps=200, lr=1e-2, **common)
    return first, last, root / "d2"


@pytest.fixture(scope="module")
def drafter(trained):
    return Drafter.load(trained[2], hidden_size=32, vocab_size=64)


# -- the drafter and Apple's layout ----------------------------------------------------------
def apple_logits(state: dict, context, embeds, rnn=True, layers=2):
    """Apple's drafter written out from the paper's formulas over the checkpoint's tensors:
    s_k = SiLU(W e_{k-1} + U s_{k-1} + b_u) (rnn) or e_{k-1} + s_{k-1}; [c ; s_k] ->
    (input_proj) -> ResBlocks x + SiLU(A x + a) -> vocabulary projection."""
    s = torch.zeros_like(context)
    out = []
    for k in range(embeds.shape[1]):
        e = embeds[:, k]
        s = F.silu(e @ state["rnn_w.weight"].T + s @ state["rnn_u.weight"].T + state["rnn_u.bias"]) if rnn else e + s
        x = torch.cat([context, s], -1)
        if "input_proj.weight" in state:
            x = x @ state["input_proj.weight"].T + state["input_proj.bias"]
        for i in range(layers):
            x = x + F.silu(x @ state[f"lm_head.{i}.linear.weight"].T + state[f"lm_head.{i}.linear.bias"])
        out.append(x @ state[f"lm_head.{layers}.weight"].T)
    return torch.stack(out, 1)


def apple_state(hidden=32, vocab=64, layers=2, exit_dim=None, rnn=True, seed=0) -> dict:
    """A state dict under Apple's tensor names, built by hand (not from our module)."""
    g = torch.Generator().manual_seed(seed)
    exit_dim = exit_dim or 2 * hidden
    state = {}
    if exit_dim != 2 * hidden:
        state["input_proj.weight"] = torch.randn(exit_dim, 2 * hidden, generator=g) * 0.2
        state["input_proj.bias"] = torch.randn(exit_dim, generator=g) * 0.2
    for i in range(layers):
        state[f"lm_head.{i}.linear.weight"] = torch.randn(exit_dim, exit_dim, generator=g) * 0.2
        state[f"lm_head.{i}.linear.bias"] = torch.randn(exit_dim, generator=g) * 0.2
    state[f"lm_head.{layers}.weight"] = torch.randn(vocab, exit_dim, generator=g) * 0.2
    if rnn:
        state["rnn_u.weight"] = torch.randn(hidden, hidden, generator=g) * 0.2
        state["rnn_u.bias"] = torch.randn(hidden, generator=g) * 0.2
        state["rnn_w.weight"] = torch.randn(hidden, hidden, generator=g) * 0.2
    return state


def write_apple_dir(path, state, hidden=32, vocab=64, layers=2, exit_dim=None, rnn=True, fmt="safetensors"):
    """config.json as Apple's DrafterConfig.save_pretrained writes it, and the weights."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "recurrent_drafting_drafter", "architectures": ["Drafter"], "vocab_size": vocab,
           "hidden_size": hidden, "exit_dim": exit_dim or 2 * hidden, "num_draft_layers": layers,
           "num_lookback_tokens": -1, "rnn": rnn, "torch_dtype": "float32", "transformers_version": "4.40.0"}
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "model.pt")
    return path


@pytest.mark.parametrize("variant", [
    dict(), dict(exit_dim=48), dict(rnn=False, layers=1), dict(layers=0), dict(fmt="pt"),
    dict(prefix="lm_heads."), dict(prefix="0."), dict(exit_dim=48, prefix="input_projs."),
], ids=["default", "input_proj", "no-rnn", "no-resblocks", "model.pt", "lm_heads", "0.", "input_projs"])
def test_apple_layout_loads_and_computes_apples_drafter(tmp_path, variant):
    variant = dict(variant)
    prefix, fmt = variant.pop("prefix", None), variant.pop("fmt", "safetensors")
    state = apple_state(**variant)
    on_disk = dict(state)
    if prefix:  # TensorRT-LLM's converter also reads these spellings
        head = "input_proj." if prefix == "input_projs." else "lm_head."
        on_disk = {(prefix + k[len(head):] if k.startswith(head) else k): v for k, v in state.items()}
        assert on_disk != state
    write_apple_dir(tmp_path, on_disk, fmt=fmt, **variant)
    drafter = Drafter.load(tmp_path, hidden_size=32, vocab_size=64)
    g = torch.Generator().manual_seed(1)
    context, embeds = torch.randn(5, 32, generator=g), torch.randn(5, 4, 32, generator=g)
    with torch.no_grad():
        expected = apple_logits(state, context, embeds, variant.get("rnn", True), variant.get("layers", 2))
        torch.testing.assert_close(drafter.forward_sequence(context, embeds), expected, atol=1e-5, rtol=1e-5)
    # and back out: our save is Apple's layout, tensor for tensor
    drafter.save(tmp_path / "again")
    from safetensors.torch import load_file

    assert {k: v.shape for k, v in load_file(str(tmp_path / "again" / "model.safetensors")).items()} == \
        {k: v.shape for k, v in state.items()}
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter"
    assert {k: cfg[k] for k in ("vocab_size", "hidden_size", "num_draft_layers", "rnn")} == {
        "vocab_size": 64, "hidden_size": 32, "num_draft_layers": variant.get("layers", 2), "rnn": variant.get("rnn", True)}


def test_bad_drafter_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Drafter.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Drafter.load(tmp_path)
    good = {"model_type": "recurrent_drafting_drafter", "vocab_size": 64, "hidden_size": 32, "exit_dim": 64,
            "num_draft_layers": 2, "rnn": True}
    for bad, message in [({"model_type": "llama"}, "model_type 'llama'"), ({"vocab_size": None}, "vocab_size must"),
                         ({"hidden_size": "32"}, "hidden_size must"), ({"num_draft_layers": -1}, "num_draft_layers"),
                         ({"exit_dim": 0}, "exit_dim must"), ({"rnn": "yes"}, "rnn must")]:
        (tmp_path / "config.json").write_text(json.dumps({**good, **bad}))
        with pytest.raises(ValueError, match=message):
            Drafter.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match="lacks"):
        Drafter.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(good))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Drafter.load(tmp_path)
    with pytest.raises(ValueError, match="hidden size 32, the target has 64"):
        Drafter.load(tmp_path, hidden_size=64)
    with pytest.raises(ValueError, match="vocab size 64, the target 128"):
        Drafter.load(tmp_path, vocab_size=128)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable weights file"):
        Drafter.load(tmp_path)
    state = apple_state()
    del state["rnn_w.weight"]
    write_apple_dir(tmp_path, state)
    with pytest.raises(ValueError, match="does not match"):
        Drafter.load(tmp_path)
    write_apple_dir(tmp_path, apple_state(exit_dim=48))  # weights of another shape than config.json says
    (tmp_path / "config.json").write_text(json.dumps(good))
    with pytest.raises(ValueError, match="does not match"):
        Drafter.load(tmp_path)


# -- beam search and packing -----------------------------------------------------------------
def reference_beam_search(drafter, context, root, embed, m, length):
    """Beam search written plainly: each level, every (beam, token) extension of every kept
    beam, scored by the summed log-probs of its whole sequence recomputed from scratch."""
    def score(seq):  # seq: drafted tokens after the root
        state, total = None, 0.0
        tokens = [root] + seq
        for k in range(len(seq)):
            state = drafter.next_state(embed(torch.tensor(tokens[k])), state)
            total += float(drafter.log_probs(context, state)[tokens[k + 1]])
        return total

    beams = [[]]
    for _ in range(length):
        ext = [b + [t] for b in beams for t in range(embed.weight.shape[0])]
        scores = [score(b) for b in ext]
        order = sorted(range(len(ext)), key=lambda i: -scores[i])
        beams = [ext[i] for i in order[:m] if scores[i] > -float("inf")]
    return beams


@torch.no_grad()
def test_beam_search_keeps_the_best_extensions_at_every_level():
    d = random_drafter(vocab=12, std=0.5)
    embed = torch.nn.Embedding(12, 32)
    torch.nn.init.normal_(embed.weight)
    g = torch.Generator().manual_seed(0)
    context, roots = torch.randn(3, 32, generator=g), torch.tensor([1, 5, 7])
    beams, scores = d.beam_search(context, roots, embed, num_beams=4, length=3)
    assert beams.shape == (3, 4, 3) and (scores[:, :-1] >= scores[:, 1:]).all()
    for i in range(3):
        ref = reference_beam_search(d, context[i], int(roots[i]), embed, 4, 3)
        assert beams[i].tolist() == ref
        assert len({tuple(b) for b in beams[i].tolist()}) == 4  # distinct beams


def paths_as_tokens(tokens, tree: TokenTree) -> list[list[int]]:
    return [[tokens[n - 1] for n in row if n > 0] for row in tree.paths.tolist()]


def test_packing_hand_made_beams():
    beams = [[5, 6, 7, 1], [5, 6, 8, 2], [4, 6, 7, 1], [5, 9, 7, 1]]
    tokens, parents, kept = pack_beams(beams, budget=100)
    tree = TokenTree.from_parents(parents)
    assert sorted(paths_as_tokens(tokens, tree)) == sorted(beams)
    assert len(tokens) == len({tuple(b[:d]) for b in beams for d in range(1, 5)}) == 13 < 16
    assert kept == [4, 4, 4, 4]
    # cut: whole beams first, in order, every kept node's parent kept
    tokens, parents, kept = pack_beams(beams, budget=7)
    assert kept == [4, 4, 1, 0] and tokens[:4] == beams[0] and all(p <= i for i, p in enumerate(parents))
    assert sorted(paths_as_tokens(tokens, TokenTree.from_parents(parents))) == [[4], [5, 6, 7, 1], [5, 6, 8, 2]]


@torch.no_grad()
def test_packed_tree_paths_are_the_beams_and_verify_like_sequential_decoding(target):
    """The proposer's tree per row: root-to-leaf paths = the drafter's distinct beams; the
    target verifying the packed tree gives every node the logits of decoding its beam
    sequentially after the prefix."""
    d = random_drafter(std=0.15)
    embed = target.model.embed_tokens
    prop = ReDrafterProposer(d, embed)
    prefixes = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [8, 8, 8, 8, 8]]
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 32, generator=g)
    prop.prefill([PrefillRow(i, p, p[-1], feats[i][None]) for i, p in enumerate(prefixes)])
    shapes = [(4, 3), (2, 5), (6, 2)]
    rows = [ProposalRow(i, p, num_tokens=64, options=ReDrafterOptions(num_beams=m, draft_len_per_beam=n))
            for i, (p, (m, n)) in enumerate(zip(prefixes, shapes))]
    draft = prop.propose(rows)
    for i, ((m, n), row) in enumerate(zip(shapes, draft.rows)):
        beams, _ = d.beam_search(feats[i][None], torch.tensor([prefixes[i][-1]]), embed, m, n)
        assert sorted(paths_as_tokens(row.tokens, row.tree)) == sorted(beams[0].tolist())
        assert row.size == len({tuple(b[:k]) for b in beams[0].tolist() for k in range(1, n + 1)}) <= m * n
    assert prop.counts["rows"] == 3 and prop.counts["unpacked"] == sum(m * (n + 1) for m, n in shapes)
    assert prop.counts["packed"] == sum(1 + r.size for r in draft.rows) < prop.counts["unpacked"]
    # verification of the packed trees, one forward for the three rows
    runner = ModelRunner(copy.deepcopy(target), num_slots=3, capacity=64)
    runner.forward([0, 1, 2], [p[:-1] for p in prefixes])  # cache all but the root
    q = max(r.size for r in draft.rows) + 1
    mask = torch.eye(q, dtype=torch.bool).repeat(3, 1, 1)
    depth = torch.arange(q).repeat(3, 1)
    for i, r in enumerate(draft.rows):
        mask[i, : r.tree.size, : r.tree.size] = r.tree.mask
        depth[i, : r.tree.size] = r.tree.depth
    tokens = [[p[-1]] + r.tokens for p, r in zip(prefixes, draft.rows)]
    out = runner.forward([0, 1, 2], tokens, logits_at=torch.arange(q)[None].expand(3, -1), layout=(mask, depth))
    for i, (p, r) in enumerate(zip(prefixes, draft.rows)):
        for path in r.tree.paths.tolist():
            nodes = [n for n in path if n >= 0]
            seq = p + [tokens[i][n] for n in nodes[1:]]
            expected = target(torch.tensor([seq])).logits[0, len(p) - 1 :]
            torch.testing.assert_close(out.logits[i, nodes], expected, atol=1e-5, rtol=0)


def test_trees_are_cut_to_the_room_the_step_has():
    d = random_drafter()
    embed = torch.nn.Embedding(64, 32)
    prop = ReDrafterProposer(d, embed)
    prop.commit([CommitRow(0, [1], [0], torch.randn(1, 32))])
    for room in (1, 2, 3, 7, 100):
        opts = ReDrafterOptions(num_beams=5, draft_len_per_beam=5)
        row = prop.propose([ProposalRow(0, [4, 2], num_tokens=room, options=opts)]).rows[0]
        beams, _ = d.beam_search(prop._last[0][None], torch.tensor([2]), embed, 5, min(room, 5))
        whole = len(pack_beams(beams[0].tolist(), 10**6)[0])
        assert row.size == min(room, whole) and row.tree.max_depth == min(room, 5)
        best = beams[0, 0].tolist()
        assert row.tokens[: len(best)] == best[: row.size]  # the best beam is kept whole first


def test_cut_trees_stay_lossless(target):
    engine = redrafter_engine(target, random_drafter(), max_num_seqs=2, max_model_len=20)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                           SpeculationParams(method="redrafter", num_beams=6, draft_len_per_beam=6))
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and len(p) + len(o.token_ids) == 20
        assert o.token_ids == hf_greedy(target, p, 20 - len(p))


# -- lossless ----------------------------------------------------------------------------------
SHAPES = {"default (4x4)": {}, "one beam": {"num_beams": 1, "draft_len_per_beam": 4},
          "8x3": {"num_beams": 8, "draft_len_per_beam": 3}, "5x5 (TensorRT-LLM)": {"num_beams": 5, "draft_len_per_beam": 5}}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_redrafter_equals_hf_generate(target, drafter, references, name, batch):
    engine = redrafter_engine(target, drafter, max_num_seqs=batch)
    prompts = ragged_prompts(8 if batch > 1 else 3)  # 8 prompts on 4 slots: requests join mid-run
    outs = engine.generate(prompts, GREEDY, SpeculationParams(method="redrafter", **SHAPES[name]))
    assert [o.token_ids for o in outs] == references[: len(prompts)]
    assert engine.totals.num_accepted_tokens > 0  # trees were accepted, KV compacted


def test_mixed_methods_in_one_batch(tiny_pair, drafter, references):
    from tests.test_eagle import random_head
    from tests.test_medusa import random_heads

    target, draft = tiny_pair
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, speculation_length=SpeculationLengthPolicy()),
                       target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft),
                       resources={"redrafter": copy.deepcopy(drafter), "eagle": random_head(target),
                                  "medusa": random_heads()})
    methods = [{"method": "redrafter"}, {"method": "draft"}, {"method": "redrafter", "num_beams": 2},
               {"method": "eagle", "dynamic_tree": True}, {"method": "medusa"}, {"method": "ngram"},
               {"method": "none"}, {"method": "redrafter", "draft_len_per_beam": 2}]
    outs = engine.generate(ragged_prompts(8), GREEDY, [SpeculationParams(**m) for m in methods])
    assert [o.token_ids for o in outs] == references
    assert sum(o.metrics["num_accepted_tokens"] for o, m in zip(outs, methods) if m["method"] == "redrafter") > 0


@pytest.mark.parametrize("shape", [(3, 3), (1, 3)], ids=["3 beams", "one beam"])
def test_tree_sampling_keeps_the_target_distribution(shape):
    """Beams are deterministic proposals (one-hot q): recursive rejection over siblings keeps
    the target's distribution; a biased sampler is caught by the same test."""
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, check, exact_joint

    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    engine = redrafter_engine(target, random_drafter(vocab=VOCAB, std=0.5), max_num_seqs=64)
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params,
                           SpeculationParams(method="redrafter", num_beams=shape[0], draft_len_per_beam=shape[1]))
    t = engine.totals
    assert t.num_drafts > N // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    seqs = np.array([o.token_ids for o in outs])
    assert min(check(seqs, exact_joint(target))) > 1e-3
    biased = seqs.copy()  # negative control: the same test catches a plausible bug
    biased[: N // 5, 1:] = biased[: N // 5, :1]
    assert min(check(biased, exact_joint(target))) < 1e-3


def test_requests_are_validated(target):
    for bad, field in [({"num_beams": 0}, "num_beams"), ({"num_beams": 51}, "num_beams"),
                       ({"draft_len_per_beam": 0}, "draft_len_per_beam"),
                       ({"draft_len_per_beam": 17}, "draft_len_per_beam"), ({"beams": 4}, "beams")]:
        with pytest.raises(ValueError, match=field):
            SpeculationParams(method="redrafter", **bad)
    small = tiny_llama(vocab=8)
    engine = redrafter_engine(small, random_drafter(vocab=8))
    with pytest.raises(ValueError, match=r"num_beams: 9 exceeds the vocabulary \(8\)"):
        engine.add_request([1, 2], GREEDY, SpeculationParams(method="redrafter", num_beams=9))
    plain = LLMEngine(EngineConfig(target="x"), target_model=copy.deepcopy(target))
    with pytest.raises(ValueError, match="needs a ReDrafter drafter"):
        plain.add_request([1, 2], GREEDY, SpeculationParams(method="redrafter"))


# -- training ----------------------------------------------------------------------------------
def test_training_learns_and_saves_apples_layout(trained, target):
    """A short self-distillation on the tiny target: the loss falls, held-out accuracy and the
    beams' accepted length rise, the saved drafter loads and serves losslessly."""
    first, last, path = trained
    assert last["final_loss"] < first["final_loss"] - 0.5, (first, last)
    # a random 2-layer target is hard to guess two tokens ahead: a modest, clear rise
    assert last["held_out_top1_per_level"][0] > first["held_out_top1_per_level"][0] + 0.04
    assert last["held_out_beams"]["4x3"]["accepted_length"] > first["held_out_beams"]["4x3"]["accepted_length"]
    assert last["held_out_beams"]["4x3"]["accepted_length"] >= last["held_out_beams"]["1x3"]["accepted_length"]
    assert last["held_out_beams"]["4x3"]["verified_packed"] < last["held_out_beams"]["4x3"]["verified_unpacked"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter" and cfg["exit_dim"] == 64 and cfg["rnn"] is True
    engine = redrafter_engine(target, Drafter.load(path, hidden_size=32, vocab_size=64))
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="redrafter"))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    assert engine.totals.num_accepted_tokens > 0


# -- entry points ------------------------------------------------------------------------------
def test_engine_loads_the_checkpoint_by_its_key(tiny_checkpoints, trained, target):
    """From checkpoint dirs, under the default self-tuning speculation length (which may
    switch a request's tree off, never its output)."""
    engine = LLMEngine(EngineConfig(target=tiny_checkpoints["target"], checkpoints={"redrafter": str(trained[2])}))
    assert engine.limits.methods["redrafter"] == {"hidden_size": 32, "vocab_size": 64}
    for spec in ({"num_beams": 3}, {}):
        outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method="redrafter", **spec))
        assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(3)]
    assert engine.totals.num_drafts > 0


def test_redrafter_through_the_coordinator(tiny_coordinator, tiny_pair):
    """The separate layout (colocated: test_colocated_tp2_every_method, the engine tests), random
    weights: acceptance is the engine tests' (trained drafters)."""
    from tests.test_actors import GREEDY as GREEDY_DICT, PROMPTS

    target, c = tiny_pair[0], tiny_coordinator
    specs = [{"method": "redrafter", "num_beams": 1 + i % 4, "draft_len_per_beam": 2 + i % 3}
             for i in range(len(PROMPTS))]
    refs = [c.generate.remote([p], GREEDY_DICT, s) for p, s in zip(PROMPTS, specs)]
    outs = [ray.get(r)[0] for r in refs]
    assert [o["token_ids"] for o in outs] == [hf_greedy(target, p, GREEDY_DICT["max_tokens"]) for p in PROMPTS]
    assert sum(o["metrics"]["num_drafts"] for o in outs) > 0
    with pytest.raises(ValueError, match="num_beams"):
        ray.get(c.generate.remote([[1, 2]], GREEDY_DICT, {"method": "redrafter", "num_beams": 0}))


def test_a_batch_job_refuses_a_bad_redrafter_line(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    """Before anything starts (ReDrafter's lines that run: tests/test_batch_methods.py)."""
    from specray.entrypoints import jobs

    random_drafter().save(tmp_path / "redrafter")
    config = tmp_path / "cfg.yaml"
    config.write_text(f"target: {tiny_checkpoints['target']}\ndraft: {tiny_checkpoints['draft']}\n"
                      f"checkpoints:\n  redrafter: {tmp_path / 'redrafter'}\nmax_num_seqs: 3\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [1], "speculation": {"method": "redrafter", "num_beams": 99}}) + "\n")
    monkeypatch.setattr("specray.actors.coordinator.Coordinator", None)  # any use of it fails
    assert jobs.main(["--input", str(bad), "--output", str(tmp_path / "o2.jsonl"), "--config", str(config)]) == 2
    assert "num_beams" in capsys.readouterr().err


def test_cli_flags_and_generate(tiny_checkpoints, tiny_pair, trained, tmp_path, capsys):
    from specray.entrypoints.cli import main
    from tests.conftest import ALPHABET, save_char_tokenizer

    target_dir = tmp_path / "target"
    tiny_pair[0].save_pretrained(target_dir)
    save_char_tokenizer(target_dir)
    common = ["generate", "--prompt", "dbdbfjcg", "--target", str(target_dir), "--max-tokens", "12", "--json"]
    assert main([*common, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["token_ids"] == hf_greedy(tiny_pair[0], [ALPHABET.index(c) for c in "dbdbfjcg"], 12)
    assert main([*common, "--method", "redrafter", "--redrafter", str(trained[2]), "--num-beams", "3",
                 "--draft-len-per-beam", "2"]) == 0
    rd = json.loads(capsys.readouterr().out)
    assert rd["token_ids"] == plain["token_ids"] and rd["metrics"]["num_drafts"] > 0
    assert main([*common, "--method", "redrafter"]) == 2
    assert "--method redrafter needs --redrafter DIR" in capsys.readouterr().err
    assert main([*common, "--method", "redrafter", "--redrafter", str(trained[2]), "--num-beams", "0"]) == 2
    assert "--num-beams 0" in capsys.readouterr().err


def test_beams_packed_on_the_device_as_on_the_host():
    """``pack_on_device`` builds ``pack_beams``' tree for a batch without reading it back:
    the same node tokens and parents (random beams sharing prefixes, every budget), the
    rest of the fixed size padded with copies of node 1, and the same packing counts."""
    import random

    from specray.policies.redrafter import pack_beams, pack_on_device

    rng = random.Random(0)
    for _ in range(200):
        m, length = rng.randint(1, 5), rng.randint(2, 5)
        beams = set()
        while len(beams) < m:  # distinct beams, as beam search makes them
            beams.add(tuple(rng.randint(0, 2) for _ in range(length)))
        beams = [list(b) for b in beams]
        rng.shuffle(beams)
        size = rng.randint(1, m * length)
        tokens, parents, kept = pack_beams(beams, size)
        got_tokens, got_parents, counts = pack_on_device(torch.tensor([beams]), size)
        n = len(tokens)
        assert got_tokens[0, :n].tolist() == tokens and got_parents[0, :n].tolist() == parents
        assert got_tokens[0, n:].tolist() == [beams[0][0]] * (size - n) and got_parents[0, n:].tolist() == [0] * (size - n)
        assert counts.tolist() == [1, 1 + n, sum(1 + k for k in kept if k)]
