"""The single-process speculative engine with continuous batching.

    engine = LLMEngine(EngineConfig())                 # the built-in demo pair
    engine.add_request("def fib(n):", SamplingParams(max_tokens=32, temperature=0),
                       SpeculationParams(method="draft", num_speculative_tokens=4))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each ``step`` admits waiting requests (a batched prefill that samples their first
token), then runs one speculative step over the running batch:
propose -> verify -> accept -> commit (see ``_speculate``). Requests join and leave
between steps; a row's tokens never depend on the other rows.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Iterable, Sequence

import torch

from specray.engine.config import EngineConfig
from specray.engine.metrics import SpecMetrics
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.request import Request, RequestOutput
from specray.engine.runner import ModelRunner
from specray.engine.verify import accept, sampling_tensors
from specray.kernels.sampling import probs_from_logits, sample
from specray.policies.base import Draft, ProposalRow, SamplingView, proposer_factory, registered_methods

# Importing the proposer modules registers them by name.
from specray.policies import draft_model as _draft_model  # noqa: F401
from specray.policies import prompt_lookup as _prompt_lookup  # noqa: F401

log = logging.getLogger(__name__)

PLAIN = "none"


class LLMEngine:
    """Target model + proposers + request queue. Not thread-safe; actors wrap it."""

    def __init__(self, config: EngineConfig | None = None, *, target_model=None, draft_model=None, tokenizer=None):
        self.config = config = config or EngineConfig()
        if target_model is None:  # from checkpoints (in-memory models are for tests/embedding)
            paths = config.resolved_paths()
            target_model = config.load_model(paths.target)
            if draft_model is None and paths.draft is not None:
                draft_model = config.load_model(paths.draft)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer)
        self.tokenizer = tokenizer
        self.capacity = config.context_length(target_model.config)
        self.target = ModelRunner(target_model, config.max_num_seqs, self.capacity)
        self.draft_model = draft_model
        self.eos_ids = _eos_ids(target_model, tokenizer)
        self._proposers: dict[str, object] = {}
        self._free_slots = list(range(config.max_num_seqs))
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self._ids = itertools.count()
        self.totals = SpecMetrics()

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        speculation: SpeculationParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        sampling = sampling or SamplingParams()
        speculation = speculation or self.config.default_speculation
        self.check_method(speculation.method)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.capacity:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.capacity} "
                "tokens and generation needs at least one more"
            )
        vocab = self.target.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(sampling.seed)
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_ids)
        self.waiting.append(
            Request(request_id, prompt_ids, sampling, speculation, stop_ids, generator=generator)
        )
        return request_id

    def check_method(self, method: str) -> None:
        check_method_name(method)
        if method == "draft" and self.draft_model is None:
            raise ValueError("method 'draft' needs a draft model (EngineConfig.draft)")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its last output (finish_reason 'abort') if it existed."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                return req.output([])
        for req in list(self.running.values()):
            if req.request_id == request_id:
                req.finish_reason = "abort"
                self._release(req)
                return req.output([])
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, then one speculative step; outputs of rows that moved."""
        outputs = self._admit()
        fresh = {o.request_id for o in outputs}
        batch = [r for r in self.running.values() if r.request_id not in fresh]
        if batch:
            outputs += self._speculate(batch)
        return outputs

    def _speculate(self, batch: list[Request]) -> list[RequestOutput]:
        draft, has_probs = self._propose(batch)
        verify_tokens = [
            [r.output_ids[-1]] + draft.tokens[i, : int(draft.lengths[i])].tolist() for i, r in enumerate(batch)
        ]
        k = draft.max_len
        logits = self.target.forward(
            [r.slot for r in batch], verify_tokens, logits_at=torch.arange(k + 1)[None].expand(len(batch), -1)
        ).logits  # [B, K+1, V]
        result = accept(batch, draft, has_probs, logits)
        return self._commit(batch, draft, result)

    def _propose(self, batch: list[Request]) -> tuple[Draft, list[bool]]:
        """One Draft for the whole batch, gathered from each method's proposer."""
        groups: dict[str, list[int]] = {}
        ks = []
        for i, r in enumerate(batch):
            # Never draft past max_tokens or the context: k <= remaining - 1, and the
            # target must fit the last token + k drafts.
            k = min(r.speculation.num_speculative_tokens, r.remaining - 1, self.capacity - r.num_tokens)
            ks.append(max(k, 0))
            if r.speculation.method != PLAIN and k > 0:
                groups.setdefault(r.speculation.method, []).append(i)
        tokens_lists: list[list[int]] = [[] for _ in batch]
        probs_rows: dict[int, torch.Tensor] = {}
        for method, idx in groups.items():
            rows = [self._proposal_row(batch[i], ks[i]) for i in idx]
            part = self._proposer(method).propose(rows)
            for n, i in enumerate(idx):
                length = min(int(part.lengths[n]), ks[i])
                tokens_lists[i] = part.tokens[n, :length].tolist()
                if part.probs is not None and not batch[i].sampling.greedy:
                    probs_rows[i] = part.probs[n, :length]
        draft = Draft.from_lists(tokens_lists)
        has_probs = [i in probs_rows for i in range(len(batch))]
        if probs_rows:
            probs = torch.zeros(len(batch), draft.max_len, self.target.vocab_size)
            for i, p in probs_rows.items():
                probs[i, : p.shape[0]] = p
            draft = Draft(draft.tokens, draft.lengths, probs)
        return draft, has_probs

    def _proposal_row(self, r: Request, k: int) -> ProposalRow:
        s = r.sampling
        return ProposalRow(
            slot=r.slot,
            token_ids=r.token_ids,
            num_tokens=k,
            sampling=SamplingView(s.temperature, s.top_p, s.effective_top_k),
            generator=r.generator,
            options={"max_matching_ngram_size": r.speculation.max_matching_ngram_size},
        )

    def _commit(self, batch: list[Request], draft: Draft, result) -> list[RequestOutput]:
        by_method: dict[str, tuple[list[int], list[int]]] = {}
        outputs = []
        for i, r in enumerate(batch):
            n = int(result.num_accepted[i])
            drafted = int(draft.lengths[i])
            # The target cache now holds the last committed token + the n accepted drafts.
            self.target.set_length(r.slot, r.num_tokens + n)
            if drafted:
                slots, counts = by_method.setdefault(r.speculation.method, ([], []))
                slots.append(r.slot)
                counts.append(n)
            r.metrics.record_draft(drafted, n)
            r.metrics.target_forward_passes += 1
            kept = r.append(result.emitted(i), self.capacity, self.tokenizer)
            outputs.append(r.output(kept))
        for method, (slots, counts) in by_method.items():
            self._proposer(method).commit(slots, counts)
        for r in batch:
            if r.finished:
                self._release(r)
        return outputs

    # -- admission (prefill) -----------------------------------------------------------
    def _admit(self) -> list[RequestOutput]:
        joining = []
        while self.waiting and self._free_slots:
            req = self.waiting.popleft()
            req.slot = self._free_slots.pop(0)
            self.target.reset(req.slot)
            self.running[req.slot] = req
            joining.append(req)
        if not joining:
            return []
        logits = self.target.forward([r.slot for r in joining], [r.prompt_ids for r in joining]).logits[:, 0]
        first = self._sample_one(joining, logits)
        outputs = []
        for r, tok in zip(joining, first):
            r.metrics.target_forward_passes += 1
            kept = r.append([tok], self.capacity, self.tokenizer)
            outputs.append(r.output(kept))
            if r.finished:
                self._release(r)
        return outputs

    def _sample_one(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:  # logits [B, V]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
        if sampled:
            temperature, top_k, top_p = sampling_tensors([reqs[i] for i in sampled])
            at = torch.tensor(sampled)
            probs = probs_from_logits(logits[at], temperature, top_k, top_p)
            tokens[at] = sample(probs, [reqs[i].generator for i in sampled])
        return tokens.tolist()

    def _release(self, r: Request) -> None:
        if self.running.pop(r.slot, None) is None:
            return
        self.target.reset(r.slot)
        for proposer in self._proposers.values():
            proposer.release(r.slot)
        self._free_slots.append(r.slot)
        self._free_slots.sort()
        self.totals.merge(r.metrics)

    def _proposer(self, method: str):
        if method not in self._proposers:
            resources = {"vocab_size": self.target.vocab_size}
            if self.draft_model is not None:
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


def check_method_name(method: str) -> None:
    """Raise ValueError unless ``method`` is 'none' or a registered proposer."""
    if method != PLAIN and method not in registered_methods():
        raise ValueError(f"unknown speculation method {method!r}; known: {[PLAIN] + registered_methods()}")


def _per_prompt(value, n: int) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} parameter sets for {n} prompts")
    return list(value)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
