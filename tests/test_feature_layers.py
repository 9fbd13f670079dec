"""The target hands over the hidden states entering chosen decoder layers (EAGLE-3's taps):
the runner's taps equal HF's ``output_hidden_states``, and a method naming
``feature_layers`` gets them, concatenated, for the prompt and every accepted token."""

import copy
from typing import Literal

import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SpeculationParams
from specray.engine.runner import ModelRunner
from specray.policies.base import Draft
from specray.policies.registry import LinearOptions, MethodSpec, register_method, unregister_method
from tests.conftest import tiny_llama
from tests.test_eagle3 import taps_of
from tests.test_engine import GREEDY, ragged_prompts


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=128,
                                           bos_token_id=None, eos_token_id=None)).eval()


@pytest.mark.parametrize("make", [lambda: tiny_llama(layers=4), tiny_gpt2], ids=["llama (direct loop)", "gpt2 (HF forward)"])
def test_taps_equal_hf_hidden_states_with_a_cache(make):
    model = make()
    runner = ModelRunner(copy.deepcopy(model), num_slots=2, capacity=64)
    seqs, cut = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], [4, 1]
    first = runner.forward([0, 1], [s[:c] for s, c in zip(seqs, cut)], layers=(0, 2))
    then = runner.forward([0, 1], [s[c:] for s, c in zip(seqs, cut)], layers=(0, 2))  # on the cache, ragged
    for i, (s, c) in enumerate(zip(seqs, cut)):
        with torch.no_grad():
            ref = model(torch.tensor([s]), output_hidden_states=True).hidden_states
        for k in (0, 2):
            got = torch.cat([first.layers[k][i, :c], then.layers[k][i, : len(s) - c]])
            torch.testing.assert_close(got, ref[k][0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="decoder layers"):
        runner.forward([0], [[1]], layers=(runner.num_layers,))


class Recorder:
    """Proposes nothing; remembers the features each prefill/commit handed it."""

    def __init__(self):
        self.seen: dict[int, list[torch.Tensor]] = {}
        self.tokens: dict[int, list[int]] = {}

    def prefill(self, rows):
        for r in rows:
            self.seen[r.slot] = [r.features]
            self.tokens[r.slot] = list(r.token_ids)

    def propose(self, rows):
        return Draft.from_lists([[r.token_ids[-1]] for r in rows])  # one (often wrong) node: a tree path

    def commit(self, rows):
        for r in rows:
            self.seen[r.slot].append(r.features)
            self.tokens[r.slot] += r.tokens[:-1]

    def release(self, slot):
        pass


class TapOptions(LinearOptions):
    method: Literal["taps"] = "taps"


def test_a_method_naming_feature_layers_gets_them_for_every_committed_token(target):
    recorder = Recorder()
    register_method(MethodSpec("taps", TapOptions, build=lambda ctx: recorder, needs_features=True,
                               checkpoint="taps", load=lambda p, ctx: None, feature_layers=lambda res: (1, 0)))
    try:
        engine = LLMEngine(EngineConfig(target="x", max_num_seqs=2), target_model=copy.deepcopy(target),
                           resources={"taps": "weights"})
        prompts = ragged_prompts(2)
        outs = engine.generate(prompts, GREEDY, TapOptions(method="taps"))
        for slot, (p, o) in enumerate(zip(prompts, outs)):
            seq = p + o.token_ids
            feats = torch.cat(recorder.seen[slot])  # [n, 2H]: layer 1's input, then layer 0's
            n = feats.shape[0]
            ref = taps_of(target, seq[:n], (1, 0))
            torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)
            assert n == len(p) + len(o.token_ids) - 1  # every position the target has seen
    finally:
        unregister_method("taps")
