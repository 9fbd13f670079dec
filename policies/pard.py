"""PARD: a parallel draft model that proposes k tokens in one forward from k - 1 mask tokens.

PARD (An et al., ICLR 2026; AMD's ``amd/PARD-*`` checkpoints) adapts a small causal LM so that
after the committed tokens it reads k - 1 copies of a mask token (``pard_token`` in its
config.json) and predicts, at the last committed token and at each mask, the token one place
further on: one draft forward per step instead of k. Where the draft model (``draft_model.py``)
feeds its own k - 1 guesses back one forward at a time, PARD's j-th guess conditions on the
committed prefix and j - 1 masks only. The draft model is target-independent (one PARD model
serves a whole family of targets).

Its cache holds a prefix of each row's committed tokens; a step feeds the ones it lacks (the
accepted drafts and the new root) followed by the masks, and the masks' KV is discarded right
away (their rows are rolled back: an integer), so nothing is ever rolled back at commit:

    committed:    t_0 .. t_{L-1}                       (root t_{L-1})
    fed:          t_a .. t_{L-1} m m .. m   (k - 1 masks)   -> k logits: t_L .. t_{L+k-1}
    cache after:  t_0 .. t_{L-1}

Greedy rows propose each position's argmax; sampled rows draw each position from the draft's
processed distribution there and carry it as q: position j's token is drawn independently of
the others given the prefix, so rejection sampling with that q stays exact.

Requests select it as vLLM does, ``{"method": "draft", "parallel_drafting": true}`` (or
``"draft_model"``, or ``"pard"``), with ``num_speculative_tokens`` at most the number of
positions the model was trained for (``pard_max_tokens``, saved by ``specray train pard``;
published checkpoints do not say, and take any k). Weights: ``--pard DIR`` (or vLLM's
``--speculative-config '{"method": "draft_model", "parallel_drafting": true, "model": DIR}'``):
a Hugging Face causal LM directory whose config.json names the mask token as ``pard_token``
(AMD's), ``ptd_token_id``, or ``dflash_config.mask_token_id`` (the keys vLLM reads).
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal, Sequence

import torch
from pydantic import Field, field_validator

from specray.kernels.sampling import probs_from_logits, sample_from_uniform, uniforms
from specray.policies.base import CommitRow, DeviceDraft, Draft, DraftRow, ProposalRow
from specray.policies.checkpoint_files import causal_lm_facts, read_json_config
from specray.policies.draft_model import DraftModelProposer
from specray.policies.registry import LinearOptions, MethodSpec, register_method, register_variant

MAX_TOKENS_KEY = "pard_max_tokens"  # specray's key: the positions (k) the model was trained for


class PardOptions(LinearOptions):
    """The parallel draft model drafts ``num_speculative_tokens`` tokens in one forward."""

    method: Literal["pard"] = "pard"
    parallel_drafting: bool = Field(True, description="vLLM's switch: with method draft (or draft_model) it "
                                    "selects PARD; false is the draft model (method draft).")

    @field_validator("parallel_drafting")
    @classmethod
    def _parallel(cls, v):
        if not v:
            raise ValueError("PARD drafts in parallel: for the autoregressive draft model use method draft")
        return v


def mask_token_of(config) -> int | None:
    """The mask token id a parallel draft model's config names (vLLM's order of keys), or None."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    nested = get("dflash_config") or {}
    for value in (nested.get("mask_token_id") if isinstance(nested, dict) else None, get("pard_token"),
                  get("ptd_token_id")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def draw_block(rows: Sequence[ProposalRow], ks: Sequence[int], logits: torch.Tensor):
    """A block of independently drawn positions (PARD, DFlash): logits [n, k_max, V] ->
    (tokens [n, k_max] on their device, q [n, k_max, V] of the sampled rows or None). Greedy
    rows take each position's argmax; sampled rows draw ``ks[i]`` uniforms each from their own
    generator (in position order), so their draws do not depend on the batch, and each token
    carries the distribution it was drawn from."""
    n, k_max, vocab = logits.shape
    tokens = logits.argmax(dim=-1)  # [n, k_max]
    sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
    if not sampled:
        return tokens, None
    device = logits.device
    sub = [rows[i] for i in sampled]
    sel = torch.tensor(sampled, dtype=torch.long).to(device, non_blocking=True)
    params = [torch.tensor([getattr(r.sampling, name) for r in sub for _ in range(k_max)], dtype=dt)
              .to(device, non_blocking=True)
              for name, dt in (("temperature", torch.float32), ("top_k", torch.long), ("top_p", torch.float32))]
    q = probs_from_logits(logits[sel].reshape(-1, vocab).float(), *params, check=False)  # [s * k_max, V]
    u = uniforms([ks[i] for i in sampled], [r.generator for r in sub], device, width=k_max)  # [s, k_max]
    tokens[sel] = sample_from_uniform(q, u.reshape(-1)).view(len(sampled), k_max)
    probs = torch.zeros(n, k_max, vocab, device=device)
    probs[sel] = q.view(len(sampled), k_max, vocab)
    return tokens, probs


class PardProposer(DraftModelProposer):
    """k drafts from one forward over the uncached committed tokens and k - 1 masks."""

    def __init__(self, runner, vocab_size: int | None = None, mask_token: int | None = None,
                 max_tokens: int | None = None):
        super().__init__(runner, vocab_size)
        self.mask = mask_token if mask_token is not None else mask_token_of(runner.config)
        if self.mask is None:
            raise ValueError("a PARD model needs a mask token: pard_token in its config.json")
        self.max_tokens = max_tokens

    def _ks(self, rows: Sequence[ProposalRow]) -> list[int]:
        return [min(r.num_tokens, self.max_tokens or r.num_tokens) for r in rows]

    def _inputs(self, rows, ks):
        """Each row's fed tokens (pending + masks) and the columns whose logits are its drafts."""
        pending = self._catch_up(rows)
        fed = [p + [self.mask] * (k - 1) for p, k in zip(pending, ks)]
        k_max = max(ks)
        columns = torch.tensor([[min(len(p) - 1 + j, len(f) - 1) for j in range(k_max)]
                                for p, f in zip(pending, fed)], dtype=torch.long)  # [n, k_max]
        return fed, columns

    def _done(self, rows, ks) -> None:
        for r, k in zip(rows, ks):
            self.runner.set_length(r.slot, len(r.token_ids))  # the masks' KV is never kept
            self._base[r.slot], self._k[r.slot] = len(r.token_ids), k

    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if not rows:
            return Draft.empty(0)
        ks = self._ks(rows)
        fed, columns = self._inputs(rows, ks)
        out = self.runner.forward([r.slot for r in rows], fed, logits_at=columns)
        logits = self._fit_vocab(out.logits.flatten(0, 1)).view(len(rows), max(ks), -1)  # [n, k_max, V]
        tokens, probs = draw_block(rows, ks, logits)
        self._done(rows, ks)
        drafted = tokens.tolist()
        return Draft([DraftRow(t[:k], None, probs[i, :k] if probs is not None and not r.sampling.greedy else None)
                      for i, (r, t, k) in enumerate(zip(rows, drafted, ks))])

    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft | None:
        """The same drafts from one fixed-shape forward, the tokens never leaving the device."""
        static = getattr(self.runner, "static", None)
        if static is None or not rows:
            return None
        ks = self._ks(rows)
        fed, columns = self._inputs(rows, ks)
        out = static.run([r.slot for r in rows], fed)
        n = len(rows)
        device = self.runner.device
        every = torch.arange(n, device=device)[:, None]
        logits = out.logits[every, columns.to(device, non_blocking=True)]  # [n, k_max, V_draft]
        logits = self._fit_vocab(logits.flatten(0, 1)).view(n, max(ks), -1)
        tokens, probs = draw_block(rows, ks, logits)
        self._done(rows, ks)
        return DeviceDraft([DraftRow([0] * k) for k in ks], tokens, probs)

    def _unfed(self, row: ProposalRow, draft: DraftRow) -> list[int] | None:
        """Overlapped drafting (``DraftModelProposer.propose_ahead``) feeds the whole draft (its
        cache holds the committed tokens only) to guess the bonus token, then drafts from the
        assumed tokens as ``propose`` does."""
        fresh = self.runner.lengths[row.slot] == self._base[row.slot] == len(row.token_ids)
        return list(draft.tokens) if fresh else None

    def _rollback(self, row: CommitRow, base: int, k: int, ahead) -> int | None:
        """Nothing to undo (the masks' KV was never kept), unless the draft was fed ahead: keep its
        accepted tokens."""
        return None if ahead is None else base + min(row.num_accepted, k)


# -- checkpoints ------------------------------------------------------------------------------------
def _facts(runner) -> dict:
    return {"mask_token_id": mask_token_of(runner.config), "max_tokens": getattr(runner.config, MAX_TOKENS_KEY, None)}


def _offline_facts(path: str) -> dict:
    raw = json.loads((pathlib.Path(path) / "config.json").read_text())
    return {"mask_token_id": mask_token_of(raw), "max_tokens": raw.get(MAX_TOKENS_KEY)}


def _check(options: PardOptions, facts: dict, limits) -> None:
    most = facts.get("max_tokens")
    if most and "num_speculative_tokens" in options.model_fields_set and options.num_speculative_tokens > most:
        raise ValueError(f"speculation.num_speculative_tokens: {options.num_speculative_tokens} exceeds the "
                         f"{most} positions this PARD model was trained for")


def _inspect(path: str, target) -> dict:
    """A causal LM whose config names a mask token inside its vocabulary."""
    raw, cfg_file = read_json_config(path, "a PARD model")
    facts = causal_lm_facts(path)
    mask = mask_token_of(raw)
    if mask is None:
        raise ValueError(f"{cfg_file} names no mask token (pard_token, ptd_token_id or dflash_config.mask_token_id): "
                         f"not a parallel draft model (an ordinary draft model is --draft DIR)")
    if not 0 <= mask < facts.get("vocab_size", mask + 1):
        raise ValueError(f"{cfg_file}: pard_token {mask} is outside its vocabulary of {facts['vocab_size']}")
    return facts


def _load(path: str, ctx):
    runner = ctx.runner_for(path, name="pard")  # whole, never split with the target (a draft model at TP 1)
    if mask_token_of(runner.config) is None:
        raise ValueError(f"{path}: its config.json names no mask token (pard_token): not a PARD model")
    return runner


def _build(ctx) -> PardProposer:
    runner = ctx.resource
    return PardProposer(runner, ctx.vocab_size, max_tokens=getattr(runner.config, MAX_TOKENS_KEY, None))


register_method(MethodSpec(
    name="pard",
    options=PardOptions,
    build=_build,
    placement="worker",
    checkpoint="pard",
    recipe="specray.training.pard",
    requirement="a parallel draft model (EngineConfig.checkpoints['pard'] / --pard DIR; `specray train pard`)",
    load=_load,
    facts=_facts,
    offline_facts=_offline_facts,
    check=_check,
    inspect=_inspect,
    block=True,
))
register_variant("draft", "parallel_drafting", "pard")
