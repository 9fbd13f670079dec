"""ReDrafter, EAGLE-3, suffix decoding and lookahead through the batch-job entry point
(``jobs.main`` in this process), in both layouts: one job per layout whose lines name every one
of these methods with their option variants (beams, chain / dynamic / explicit trees, suffix
and lookahead options) and a draft-model line. Every line is greedy-identical to HF
``generate``; each line names the method that ran (lines without a speculation ran the
config's ``default_speculation``: lookahead in the separate layout, suffix in the colocated
one); the rows the engine worker drafts draft, and suffix rows asked a second time accept from
the first answers. Each method's bad lines are checked in its own file (refused before Ray)."""

import json

import pytest

from tests.conftest import hf_greedy
from tests.test_engine import ragged_prompts

REDRAFTER = [({"method": "redrafter"}, [1, 2, 3, 4]),
             ({"method": "redrafter", "num_beams": 2, "draft_len_per_beam": 3}, [9, 8, 7, 6, 5, 4]),
             ({"method": "redrafter", "num_beams": 5, "draft_len_per_beam": 5}, [5, 5])]
EAGLE3 = [({"method": "eagle3", "tree": "chain"}, [1, 2, 3, 4]),
          ({"method": "eagle3", "dynamic_tree": True, "total_tokens": 8}, [9, 8, 7, 6, 5, 4]),
          ({"method": "eagle3", "eagle_choices": [[0], [1], [0, 0]]}, [5, 5])]
DRAFT = [({"method": "draft"}, [10, 20, 30, 40, 50])]
SUFFIX_OPTIONS = [{"method": "suffix"}, {"method": "suffix", "num_speculative_tokens": 4, "max_spec_factor": 2.0},
                  {"method": "suffix"}, {"method": "suffix", "tree": False}, {"method": "suffix"}]
LOOKAHEAD_OPTIONS = [{"method": "lookahead"},
                     {"method": "lookahead", "window_size": 5, "ngram_size": 4, "verification_set_size": 2},
                     {"method": "lookahead"}, {"method": "lookahead", "shared_pool": True}, {"method": "lookahead"}]


def lines() -> list[tuple[dict, list[int], int]]:
    """(speculation, prompt, max_tokens) of every line, in input order. Suffix's prompts come
    first and again last (with max_num_seqs 3 the first answers are in the global tree before
    the second round starts); lookahead's are the same prompts."""
    prompts = ragged_prompts(5)
    suffix = [(s, p, 12) for s, p in zip(SUFFIX_OPTIONS, prompts)]
    return (suffix + [(s, p, 16) for s, p in REDRAFTER + DRAFT + EAGLE3]
            + [(s, p, 12) for s, p in zip(LOOKAHEAD_OPTIONS, prompts)] + suffix)


LAYOUTS = {
    # Lookahead and the draft model in proposer workers of their own (with the n-gram worker);
    # the heads and suffix beside the target, suffix with a tree of its own (no tree actor).
    "separate": ("lookahead", "placement:\n  timeout_s: 60\nsuffix_cache:\n  shared: false\n"),
    # Every model in one engine worker; suffix's tree shared through its actor (named here).
    "colocated": ("suffix", ("placement:\n  mode: colocated\n"
                             "suffix_cache:\n  name: suffix-test-jobs\n  max_tree_depth: 16\n")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_tree_method_in_one_batch_job(ray_session, tiny_methods, tiny_pair, layout, tmp_path):
    from specray.actors.suffix_cache import drop_shared_suffix_cache
    from specray.entrypoints import jobs

    default, placement = LAYOUTS[layout]
    heads = tiny_methods["checkpoints"]
    config = tmp_path / "cfg.yaml"
    config.write_text(f"target: {tiny_methods['target']}\ndraft: {tiny_methods['draft']}\n"
                      f"checkpoints:\n  redrafter: {heads['redrafter']}\n  eagle3: {heads['eagle3']}\n"
                      f"max_num_seqs: 3\ndefault_speculation:\n  method: {default}\n{placement}")
    wanted = lines()
    recs = [{"prompt": p, "sampling": {"max_tokens": n, "temperature": 0},
             **({} if s == {"method": default} else {"speculation": s})} for s, p, n in wanted]
    assert sum("speculation" not in r for r in recs) >= 3  # the config's default runs too
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.jsonl"
    try:
        assert jobs.main(["--input", str(inp), "--output", str(out), "--config", str(config)]) == 0
    finally:
        drop_shared_suffix_cache("suffix-test-jobs")
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["token_ids"] for o in got] == [hf_greedy(tiny_pair[0], p, n) for _, p, n in wanted]
    assert [o["method"] for o in got] == [s["method"] for s, _, _ in wanted]

    def total(method, counter, part=slice(None)):
        return sum(o["metrics"][counter] for o, (s, _, _) in list(zip(got, wanted))[part] if s["method"] == method)

    # Drafted beside the target, in the engine worker, in both layouts (random heads: drafts,
    # not acceptance; acceptance is the engine tests').
    assert total("redrafter", "num_drafts") > 0 and total("eagle3", "num_drafts") > 0
    assert total("suffix", "num_accepted_tokens", slice(-len(SUFFIX_OPTIONS), None)) > 0  # asked again
    if layout == "colocated":  # (separate: a worker of its own, which may still be loading)
        assert total("lookahead", "num_drafts") > 0
