"""The single-process speculative engine with continuous batching.

    engine = LLMEngine(EngineConfig())                 # the built-in demo pair
    engine.add_request("def fib(n):", SamplingParams(max_tokens=32, temperature=0),
                       SpeculationParams(method="draft", num_speculative_tokens=4))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each ``step`` admits waiting requests (a batched prefill that samples their first
token), then runs one speculative step over the running batch:
propose -> verify -> accept -> commit (``_speculate``; the pieces are in
``specray.engine.step`` and shared with the Ray coordinator). Requests join and leave
between steps; a row's tokens never depend on the other rows.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from specray.engine import step as S
from specray.engine.config import EngineConfig, load_tokenizer
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.request import Request, RequestOutput
from specray.engine.runner import ModelRunner
from specray.engine.scheduler import ModelLimits, Scheduler
from specray.policies.base import proposer_factory

log = logging.getLogger(__name__)


class LLMEngine:
    """Target model + proposers + request queue. Not thread-safe; actors wrap it."""

    def __init__(
        self, config: EngineConfig | None = None, *, target_model=None, draft_model=None, tokenizer=None, medusa_heads=None
    ):
        self.config = config = config or EngineConfig()
        if target_model is None:  # from checkpoints (in-memory models are for tests/embedding)
            paths = config.resolved_paths()
            target_model = config.load_model(paths.target)
            if draft_model is None and paths.draft is not None:
                draft_model = config.load_model(paths.draft)
            if tokenizer is None:
                tokenizer = load_tokenizer(paths.tokenizer)
        self.tokenizer = tokenizer
        self.capacity = config.context_length(target_model.config)
        self.target = ModelRunner(target_model, config.max_num_seqs, self.capacity)
        self.draft_model = draft_model
        if medusa_heads is None and config.medusa is not None:
            from specray.policies.medusa import MedusaHeads

            medusa_heads = MedusaHeads.load(config.medusa, hidden_size=target_model.config.hidden_size)
        self.medusa_heads = medusa_heads
        self.limits = ModelLimits(
            capacity=self.capacity,
            vocab_size=self.target.vocab_size,
            eos_ids=eos_ids(target_model, tokenizer),
            has_draft=draft_model is not None,
            medusa_heads=medusa_heads.num_heads if medusa_heads is not None else 0,
        )
        self.scheduler = Scheduler(config.max_num_seqs, self.limits, tokenizer, config.default_speculation)
        self._proposers: dict[str, object] = {}

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        speculation: SpeculationParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        return self.scheduler.add(self.scheduler.make_request(prompt, sampling, speculation, request_id))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its last output (finish_reason 'abort') if it existed."""
        return self.scheduler.abort(request_id, self._release)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def totals(self):
        """Metrics summed over finished requests."""
        return self.scheduler.totals

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, then one speculative step; outputs of rows that moved."""
        joining = self.scheduler.admit()
        outputs = self._prefill(joining) if joining else []
        fresh = {r.request_id for r in joining}
        batch = [r for r in self.scheduler.running.values() if r.request_id not in fresh]
        if batch:
            outputs += self._speculate(batch)
        return outputs

    def _speculate(self, batch: list[Request]) -> list[RequestOutput]:
        plan = S.plan_proposals(batch, self.capacity, self.config.speculation_length)
        parts = {m: self._proposer(m).propose(rows) for m, (_, rows) in plan.rows.items()}
        draft, has_probs = S.merge_drafts(batch, plan, parts, self.target.vocab_size)
        out = self.target.forward(
            [r.slot for r in batch],
            S.verify_tokens(batch, draft),
            S.logits_window(len(batch), draft),
            tree=S.tree_inputs(draft),
        )  # logits [B, K+1, V], hidden [B, K+1, H]
        result = S.accept(batch, draft, has_probs, S.TargetScores.from_logits(out.logits, S.sampled_rows(batch)))
        return self._apply(S.commit_step(batch, draft, result, self.capacity, self.tokenizer, out.hidden))

    def _prefill(self, joining: list[Request]) -> list[RequestOutput]:
        for r in joining:
            self.target.reset(r.slot)
        out = self.target.forward([r.slot for r in joining], [r.prompt_ids for r in joining])
        tokens = S.first_tokens(joining, S.TargetScores.from_logits(out.logits[:, :1], S.sampled_rows(joining)))
        return self._apply(S.commit_prefill(joining, tokens, self.capacity, self.tokenizer, out.hidden[:, 0]))

    def _apply(self, commit: S.Commit) -> list[RequestOutput]:
        for slot, length in commit.target_lengths:
            self.target.set_length(slot, length)
        if commit.target_paths:
            self.target.compact(*zip(*commit.target_paths))
        for method, (slots, counts) in commit.proposer_commits.items():
            self._proposer(method).commit(slots, counts)
        for r in commit.finished:
            self._release(r)
        return commit.outputs

    def _release(self, r: Request) -> None:
        if self.scheduler.release(r):
            self.target.reset(r.slot)
            for proposer in self._proposers.values():
                proposer.release(r.slot)

    def _proposer(self, method: str):
        if method not in self._proposers:
            resources = {"vocab_size": self.target.vocab_size, "medusa_heads": self.medusa_heads}
            if method == "draft" and self.draft_model is not None:
                resources["draft_runner"] = ModelRunner(self.draft_model, self.config.max_num_seqs, self.capacity)
            self._proposers[method] = proposer_factory(method)(**resources)
        return self._proposers[method]

    # -- convenience -------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        speculation: SpeculationParams | Sequence[SpeculationParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        prompts = list(prompts)
        samplings = _per_prompt(sampling, len(prompts))
        speculations = _per_prompt(speculation, len(prompts))
        ids = [self.add_request(p, s, sp) for p, s, sp in zip(prompts, samplings, speculations)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _per_prompt(value, n: int) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} parameter sets for {n} prompts")
    return list(value)


def eos_ids(model, tokenizer) -> frozenset[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
