"""Prompt-lookup proposer: TensorRT-LLM's documented example, the most-recent rule,
incremental index vs. brute force, slot reuse and parameter checks."""

import random

import pytest

from specray.policies.base import CommitRow, ProposalRow
from specray.policies.registry import ProposerContext, method_spec
from specray.policies.prompt_lookup import NgramIndex, PromptLookupProposer


def brute_force(tokens, num_tokens, max_ngram):
    """Reference: longest tail n-gram first, most recent earlier occurrence."""
    for n in range(max_ngram, 0, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + num_tokens]
    return []


def lookup(tokens, num_tokens=4, max_ngram=2):
    return NgramIndex().propose(tokens, num_tokens, max_ngram)


# TensorRT-LLM README (max_matching_ngram_size=2, prompt_lookup_num_tokens=4), with
# t3, t4 = 3, 4 as the sequence tail.
def test_trtllm_example_pattern_followed_by_four_tokens():
    assert lookup([10, 3, 4, 5, 6, 7, 8, 11, 3, 4]) == [5, 6, 7, 8]


def test_trtllm_example_pattern_followed_by_three_tokens():
    # Only three tokens follow the earlier [3, 4]: propose those three.
    assert lookup([3, 4, 9, 3, 4]) == [9, 3, 4]


def test_trtllm_example_falls_back_to_one_gram():
    # [3, 4] never occurred before; [4] did.
    assert lookup([1, 4, 5, 6, 7, 8, 2, 3, 4]) == [5, 6, 7, 8]


def test_trtllm_example_no_candidate():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([]) == []
    assert lookup([7]) == []


def test_most_recent_occurrence_wins():
    assert lookup([3, 4, 1, 1, 1, 1, 3, 4, 2, 2, 2, 2, 3, 4]) == [2, 2, 2, 2]


def test_longest_ngram_wins_over_more_recent_shorter_one():
    # [3, 4] matches at the start; the more recent 1-gram [4] is not used.
    assert lookup([3, 4, 1, 1, 1, 1, 4, 2, 2, 2, 2, 3, 4]) == [1, 1, 1, 1]


def test_num_tokens_caps_the_draft():
    assert lookup([10, 3, 4, 5, 6, 7, 8, 11, 3, 4], num_tokens=2) == [5, 6]


@pytest.mark.parametrize("seed", range(5))
def test_growing_sequence_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])
    max_ngram = rng.randint(1, 4)
    index = NgramIndex()
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
    for _ in range(60):
        num_tokens = rng.randint(1, 6)
        assert index.propose(tokens, num_tokens, max_ngram) == brute_force(tokens, num_tokens, max_ngram)
        tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]


def test_index_handles_larger_ngram_size_later():
    rng = random.Random(9)
    index = NgramIndex()
    tokens = [rng.randrange(3) for _ in range(40)]
    for max_ngram in (1, 3, 2, 5):
        tokens += [rng.randrange(3) for _ in range(3)]
        assert index.propose(tokens, 4, max_ngram) == brute_force(tokens, 4, max_ngram)


def test_index_rebuilds_when_sequence_does_not_extend_previous():
    index = NgramIndex()
    assert index.propose([1, 2, 3, 1, 2], 4, 2) == [3, 1, 2]
    # Shorter sequence: a new request.
    assert index.propose([5, 6, 5], 4, 2) == [6, 5]
    # Same length or longer but different content at a probed position.
    assert index.propose([7, 6, 5, 9, 5], 4, 2) == [9, 5]
    assert index.propose([7, 6, 5, 9, 5, 7], 4, 2) == [6, 5, 9, 5]


def _row(slot, tokens, num_tokens=4):
    return ProposalRow(slot=slot, token_ids=tokens, num_tokens=num_tokens)


def test_proposer_batch_draft():
    proposer = method_spec("ngram").build(ProposerContext(vocab_size=64, max_num_seqs=4, capacity=64))
    assert isinstance(proposer, PromptLookupProposer)
    draft = proposer.propose(
        [_row(0, [10, 3, 4, 5, 6, 7, 8, 11, 3, 4]), _row(1, [1, 2, 3]), _row(2, [3, 4, 9, 3, 4], num_tokens=2)]
    )
    assert draft.probs is None
    assert draft.lengths.tolist() == [4, 0, 2]
    assert draft.tokens.tolist() == [[5, 6, 7, 8], [0, 0, 0, 0], [9, 3, 0, 0]]


def test_proposer_rows_with_zero_tokens_get_no_proposal():
    draft = PromptLookupProposer().propose([_row(0, [1, 2, 1], num_tokens=0)])
    assert draft.lengths.tolist() == [0]


def test_proposer_follows_committed_tokens_only():
    rng = random.Random(3)
    proposer = PromptLookupProposer(max_matching_ngram_size=3)
    tokens = [rng.randrange(3) for _ in range(10)]
    for _ in range(30):
        draft = proposer.propose([_row(7, tokens, num_tokens=3)])
        assert draft.tokens[0, : int(draft.lengths[0])].tolist() == brute_force(tokens, 3, 3)
        # The target accepts a random prefix of the draft, then emits its own token.
        accepted = rng.randint(0, int(draft.lengths[0]))
        proposer.commit([CommitRow(7, [], list(range(accepted + 1)))])
        tokens = tokens + draft.tokens[0, :accepted].tolist() + [rng.randrange(3)]


def test_slot_reuse_does_not_leak_previous_request():
    proposer = PromptLookupProposer()
    old = [1, 2, 3, 4, 5, 1, 2]
    assert proposer.propose([_row(0, old)]).tokens.tolist() == [[3, 4, 5, 1]]
    # Released and reused.
    proposer.release(0)
    assert proposer.propose([_row(0, [1, 2])]).lengths.tolist() == [0]
    # Reused without release: a longer sequence that differs from the old one.
    proposer.propose([_row(1, old)])
    # A stale index would have matched [1, 2] against the old request's tokens.
    new = [9, 9, 8, 9, 9, 9, 8, 1, 2]
    assert brute_force(new, 4, 2) == []
    assert proposer.propose([_row(1, new)]).lengths.tolist() == [0]
    assert proposer.propose([_row(1, new + [9, 9])]).tokens.tolist() == [brute_force(new + [9, 9], 4, 2)]
    proposer.release(42)  # unknown slot: no error


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_ngram_size(bad):
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        PromptLookupProposer(max_matching_ngram_size=bad)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        NgramIndex().propose([1, 2], 4, bad)


def test_bad_num_tokens():
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        NgramIndex().propose([1, 2], 0, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookupProposer().propose([_row(0, [1, 2], num_tokens=-1)])
