"""ModelRunner: cached forward equals a full HF forward, with ragged rows and rollback."""

import copy

import pytest
import torch

from specray.engine.runner import ModelRunner
from tests.conftest import tiny_llama


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_ragged_prefill_then_decode_matches_full_forward(kv_heads):
    ref = tiny_llama(kv_heads=kv_heads)
    runner = ModelRunner(copy.deepcopy(ref), num_slots=4, capacity=64)
    prompts = {3: [1, 2, 3, 4, 5], 0: [7, 8], 2: [9, 10, 11]}  # non-contiguous slots
    out = runner.forward(list(prompts), list(prompts.values()), logits_at=torch.arange(5)[None].expand(3, -1))
    for i, ids in enumerate(prompts.values()):
        torch.testing.assert_close(out.logits[i, : len(ids)], full_logits(ref, ids), atol=1e-5, rtol=0)
        assert runner.lengths[list(prompts)[i]] == len(ids)
    # Rows now hold different lengths; append different numbers of tokens to each.
    new = {2: [12, 13, 14], 3: [6]}
    out = runner.forward(list(new), list(new.values()), logits_at=torch.arange(3)[None].expand(2, -1))
    torch.testing.assert_close(out.logits[0], full_logits(ref, [9, 10, 11, 12, 13, 14])[3:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[1, 0], full_logits(ref, [1, 2, 3, 4, 5, 6])[5], atol=1e-5, rtol=0)


def test_rollback_is_a_length():
    ref = tiny_llama()
    runner = ModelRunner(copy.deepcopy(ref), num_slots=2, capacity=32)
    runner.forward([1], [[7, 8, 12, 13, 14]])
    runner.set_length(1, 3)  # reject 13, 14
    out = runner.forward([1], [[20, 21]], logits_at=torch.tensor([[0, 1]]))
    torch.testing.assert_close(out.logits[0], full_logits(ref, [7, 8, 12, 20, 21])[3:], atol=1e-5, rtol=0)
    assert runner.lengths[1] == 5


def test_hidden_states_are_final_norm_outputs():
    ref = tiny_llama()
    runner = ModelRunner(copy.deepcopy(ref), num_slots=1, capacity=16)
    out = runner.forward([0], [[1, 2, 3]])
    with torch.no_grad():
        hidden = ref.model(torch.tensor([[1, 2, 3]])).last_hidden_state[0, -1]
    torch.testing.assert_close(out.hidden[0, 0], hidden, atol=1e-5, rtol=0)


def test_capacity_and_bad_lengths_raise():
    runner = ModelRunner(tiny_llama(), num_slots=1, capacity=4)
    with pytest.raises(ValueError, match="capacity"):
        runner.forward([0], [[1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="at least one"):
        runner.forward([0], [[]])
    with pytest.raises(ValueError):
        runner.set_length(0, 5)
