"""Draft-model proposer: a small causal LM guesses k tokens autoregressively.

It owns its own runner and KV cache (same slots as the target). Its cache holds a
prefix of each row's committed tokens; ``propose`` first feeds whatever is pending,
then samples k tokens, feeding k-1 of them back. After verification ``commit`` rolls
the cache back to the longest prefix that is still committed:

    committed before:  t_0 .. t_{L-1}                 (L = base)
    draft cache after: t_0 .. t_{L-1} d_1 .. d_{k-1}
    committed after:   t_0 .. t_{L-1} d_1 .. d_n b    -> keep L + min(n, k-1)

Greedy rows propose the argmax (no probabilities needed: token match); sampled rows
sample from the draft's own processed distribution q and return it for the rejection
sampler.
"""

from __future__ import annotations

import functools

from dataclasses import replace
from typing import Literal, Protocol, Sequence

import torch

from specray.kernels.logits import fit_vocab
from specray.kernels.sampling import probs_from_logits, sample, sample_from_uniform, uniforms
from specray.policies.base import CommitRow, DeviceDraft, Draft, DraftRow, ProposalRow
from specray.policies.checkpoint_files import causal_lm_facts
from specray.policies.compiled import inference
from specray.policies.registry import LinearOptions, MethodSpec, register_alias, register_method

# Rows with more pending tokens than this catch up in a forward of their own, so one
# freshly admitted long prompt doesn't pad every other row of the first draft forward.
CATCH_UP_THRESHOLD = 4


class Runner(Protocol):
    """What the proposer needs of ``specray.engine.runner.ModelRunner``."""

    lengths: list[int]
    vocab_size: int
    capacity: int

    def forward(self, slots, tokens, logits_at=None): ...

    def set_length(self, slot: int, length: int) -> None: ...

    def reset(self, slot: int) -> None: ...


class DraftOptions(LinearOptions):
    """A smaller causal LM drafts ``num_speculative_tokens`` tokens autoregressively."""

    method: Literal["draft"] = "draft"


# The lengths rows draft in one compiled call (``StaticForward.chain``, a graph per length,
# greedy or with sampled rows): the default k, which the engine's warm-up compiles; shorter
# lengths (the self-tuning controller's) run it and keep its first tokens. Longer ones draft
# one compiled forward at a time (warm-up compiles that forward too), so a step never waits on
# a compile.
CHAINED = frozenset({DraftOptions.model_fields["num_speculative_tokens"].default})


@functools.cache
def _chain_for(k: int) -> int | None:
    """The shortest length of ``CHAINED`` that covers k (looked up once per k)."""
    return min((c for c in CHAINED if c >= k), default=None)


class DraftModelProposer:
    def __init__(self, draft_runner: Runner, vocab_size: int | None = None, **_ignored):
        self.runner = draft_runner
        # Rejection sampling needs q over the target's vocabulary; a draft with a padded
        # or shorter head is cut or zero-padded to it.
        self.vocab_size = vocab_size or draft_runner.vocab_size
        self._base: dict[int, int] = {}
        self._k: dict[int, int] = {}
        self._ahead: dict[int, tuple[list[int], int, int]] = {}  # slot -> (assumed tokens, base, k)

    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if not rows:
            return Draft.empty(0)
        runner = self.runner
        slots = [r.slot for r in rows]
        pending = self._catch_up(rows)

        k_max = max(r.num_tokens for r in rows)
        tokens = [[] for _ in rows]  # drafted tokens per row
        is_sampled = [not r.sampling.greedy for r in rows]
        probs = torch.zeros(len(rows), k_max, self.vocab_size) if any(is_sampled) else None

        active = list(range(len(rows)))
        feed = pending
        for j in range(k_max):
            logits = self._fit_vocab(runner.forward([slots[i] for i in active], feed).logits[:, 0])  # [b, V]
            picked = logits.argmax(dim=-1).tolist()
            at = [n for n, i in enumerate(active) if is_sampled[i]]
            if at:
                sub = [rows[active[n]] for n in at]
                q = probs_from_logits(
                    logits[at],
                    torch.tensor([r.sampling.temperature for r in sub]),
                    torch.tensor([r.sampling.top_k for r in sub], dtype=torch.long),
                    torch.tensor([r.sampling.top_p for r in sub]),
                )  # [s, V]
                for n, tok in zip(at, sample(q, [r.generator for r in sub]).tolist()):
                    picked[n] = tok
                probs[[active[n] for n in at], j] = q.to(probs.device)
            for n, i in enumerate(active):
                tokens[i].append(picked[n])
            # Keep going for rows that want more tokens; the last token is not fed.
            active = [i for i in active if rows[i].num_tokens > j + 1]
            feed = [tokens[i][-1:] for i in active]
            if not active:
                break

        for r in rows:
            self._base[r.slot] = len(r.token_ids)
            self._k[r.slot] = r.num_tokens
        return Draft.from_lists(tokens, probs)

    @inference
    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft | None:
        """The same drafts made with fixed-shape forwards, the tokens never leaving the device
        (None when the runner has no fixed-shape path). Every row runs k_max forwards; rows
        that want fewer tokens roll their cache back after (an integer). Sampled rows draw
        k_max uniforms each from their own generator, so their draws do not depend on the
        batch.

        Under inference mode, as ``StaticForward.chain`` runs: the sampling inputs it hands
        the compiled chain are then inference tensors whether or not it pads them to the
        batch bucket (padding builds them anew inside that mode), so the graph's guards, which
        check the tensors' dispatch keys, hold for every batch size."""
        static = getattr(self.runner, "static", None)
        if static is None or not rows:
            return None
        runner, n = self.runner, len(rows)
        slots = [r.slot for r in rows]
        pending = self._catch_up(rows)
        k_max = max(r.num_tokens for r in rows)
        device = runner.device
        sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
        u = None
        if sampled:  # [s, k_max]
            u = uniforms([k_max] * len(sampled), [rows[i].generator for i in sampled], device)
        steps = self._chain_steps(static, k_max, slots, pending)
        if steps:  # drafts past k_max (a longer compiled chain) are dropped: their cache entries lie past the length set below
            if sampled:
                drafted, probs = static.chain(slots, pending, steps, self.vocab_size,
                                              self._chain_sampling(rows, sampled, u, steps))
                drafted, probs = drafted[:, :k_max], probs[:, :k_max]
            else:
                drafted, probs = static.chain(slots, pending, steps, self.vocab_size), None
                if drafted.shape[1] != k_max:  # (a slice is host time: only where the chain ran longer)
                    drafted = drafted[:, :k_max]
        else:
            sampling, probs = None, None
            if sampled:
                sub = [rows[i] for i in sampled]
                sel = torch.tensor(sampled, dtype=torch.long).to(device, non_blocking=True)
                params = [torch.tensor([getattr(r.sampling, name) for r in sub], dtype=dt).to(device, non_blocking=True)
                          for name, dt in (("temperature", torch.float32), ("top_k", torch.long),
                                           ("top_p", torch.float32))]
                probs = torch.zeros(n, k_max, self.vocab_size, device=device)
                sampling = (sel, u, params, probs)
            drafted = self._drafted_one_by_one(static, slots, pending, k_max, sampling)
        for r in rows:
            runner.set_length(r.slot, len(r.token_ids) + r.num_tokens - 1)
            self._base[r.slot] = len(r.token_ids)
            self._k[r.slot] = r.num_tokens
        placeholders = [DraftRow([0] * r.num_tokens) for r in rows]
        return DeviceDraft(placeholders, drafted, probs)

    def _chain_steps(self, static, k: int, slots, pending) -> int | None:
        """How many tokens the rows draft in one call (``StaticForward.chain``), or None
        (one forward at a time). Uncompiled: k. Compiled: the shortest length of ``CHAINED``
        (compiled at warm-up) that covers k, so that no length the self-tuning controller picks
        compiles a graph mid-run (a chain past k pays its extra forwards inside its one call);
        None for k = 1 (one call of one forward is the cheaper) and where no chain fits every
        row's cache."""
        if not static.chains():
            return None
        if not static.compiled:
            return k
        if k == 1:  # one forward either way: no chain's extra forwards
            return None
        steps = _chain_for(k)
        lengths, capacity = self.runner.lengths, self.runner.capacity
        if steps is None or any(lengths[s] + len(p) + steps - 1 > capacity for s, p in zip(slots, pending)):
            return None
        return steps

    def _chain_sampling(self, rows, sampled: list[int], u: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
        """``StaticForward.chain``'s sampling inputs for a batch with sampled rows: uniforms
        [n, steps] (the sampled rows' k_max draws, then zeros), temperature, top_k and top_p
        [n] (greedy rows: neutral values, their draws unused) and which rows draw [n]."""
        device = self.runner.device
        full = torch.zeros(len(rows), steps, device=device)
        full[sampled, : u.shape[1]] = u
        views = [r.sampling for r in rows]
        host = (torch.tensor([v.temperature if not v.greedy else 1.0 for v in views], dtype=torch.float32),
                torch.tensor([v.top_k if not v.greedy else 0 for v in views], dtype=torch.long),
                torch.tensor([v.top_p if not v.greedy else 1.0 for v in views], dtype=torch.float32),
                torch.tensor([not v.greedy for v in views]))
        return (full, *(t.to(device, non_blocking=True) for t in host))

    def _drafted_one_by_one(self, static, slots, pending, k_max: int, sampling) -> torch.Tensor:
        """k_max fixed-shape forwards, a token drawn after each (sampled rows: ``sampling`` =
        (their batch indices, uniforms [s, k_max], sampling parameters, probs [n, k_max, V]
        filled in here)); returns [n, k_max] tokens."""
        n, device = len(slots), self.runner.device
        last = torch.tensor([len(p) - 1 for p in pending], dtype=torch.long).to(device, non_blocking=True)
        every = torch.arange(n, device=device)
        logits = static.run(slots, pending).logits[every, last]  # [n, V_draft]
        drafted = []
        for j in range(k_max):
            logits = self._fit_vocab(logits)
            tok = logits.argmax(dim=-1)  # [n]
            if sampling:
                sel, u, params, probs = sampling
                q = probs_from_logits(logits[sel], *params, check=False)  # [s, V]
                tok[sel] = sample_from_uniform(q, u[:, j])
                probs[sel, j] = q
            drafted.append(tok)
            if j + 1 < k_max:  # the last token is not fed
                logits = static.run(slots, [[0]] * n, spliced=[(every, 0, tok[:, None])]).logits[:n, 0]
        return torch.stack(drafted, dim=1)

    def _catch_up(self, rows: Sequence[ProposalRow]) -> list[list[int]]:
        """Each row's committed tokens the cache does not hold yet; long backlogs (a freshly
        admitted prompt) are fed first in a forward of their own, all but the last token."""
        runner = self.runner
        pending = []
        for r in rows:
            if runner.lengths[r.slot] >= len(r.token_ids):  # stale slot (reused): start over
                runner.reset(r.slot)
            if runner.lengths[r.slot] == 0:  # a fresh row: from the longest prefix its cache holds (paged KV)
                runner.attach(r.slot, r.token_ids, runner.cached_prefix(r.token_ids, len(r.token_ids) - 1))
            else:  # its cached tokens are committed ones: their full blocks may serve other rows
                runner.publish(r.slot, r.token_ids)
            pending.append(list(r.token_ids[runner.lengths[r.slot] :]))
        behind = [i for i, p in enumerate(pending) if len(p) > CATCH_UP_THRESHOLD]
        if behind:
            runner.forward([rows[i].slot for i in behind], [pending[i][:-1] for i in behind])
            for i in behind:
                pending[i] = pending[i][-1:]
        return pending

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [b, V_draft] -> [b, V]
        return fit_vocab(logits, self.vocab_size)

    def propose_ahead(self, rows: Sequence[ProposalRow], drafts: Draft) -> dict[int, tuple[list[int], DraftRow]]:
        """Overlapped drafting: the next step's draft for each row, made while the target
        verifies this one, assuming the target accepts the whole draft and then adds the
        token this model expects (its guess of the bonus token). Kept until ``commit`` says
        whether that came true. Returns slot -> (the assumed tokens, the next draft)."""
        capacity = self.runner.capacity
        # After this step at best: the tokens so far, the whole draft and the guess; the next
        # draft's room is cut to what is left of the context.
        live = []
        for r, d in zip(rows, drafts.rows):
            if d.size and r.slot in self._base and len(r.token_ids) + d.size + 1 < capacity:
                unfed = self._unfed(r, d)
                if unfed is not None:
                    live.append((r, d, unfed))
        if not live:
            return {}
        saved = {r.slot: (self._base[r.slot], self._k[r.slot]) for r, _, _ in live}
        # Feeding the draft's tokens the cache lacks gives the guess at the last one.
        logits = self._fit_vocab(self.runner.forward([r.slot for r, _, _ in live], [u for _, _, u in live]).logits[:, 0])
        live = [(r, d) for r, d, _ in live]
        guesses = logits.argmax(dim=-1).tolist()
        sampled = [n for n, (r, _) in enumerate(live) if not r.sampling.greedy]
        if sampled:
            sub = [live[n][0] for n in sampled]
            q = probs_from_logits(logits[sampled], torch.tensor([r.sampling.temperature for r in sub]),
                                  torch.tensor([r.sampling.top_k for r in sub], dtype=torch.long),
                                  torch.tensor([r.sampling.top_p for r in sub]))
            for n, tok in zip(sampled, sample(q, [r.generator for r in sub]).tolist()):
                guesses[n] = tok
        ahead_rows = []
        for (r, d), g in zip(live, guesses):
            tokens = list(r.token_ids) + d.tokens + [g]
            ahead_rows.append(replace(r, token_ids=tokens, num_tokens=min(r.num_tokens, capacity - len(tokens) + 1)))
        following = self.propose(ahead_rows)
        out = {}
        for (r, d), g, nxt in zip(live, guesses, following.rows):
            assumed = d.tokens + [g]
            self._ahead[r.slot] = (assumed, self._base[r.slot], self._k[r.slot])
            self._base[r.slot], self._k[r.slot] = saved[r.slot]
            out[r.slot] = (assumed, nxt)
        return out

    def _unfed(self, row: ProposalRow, draft: DraftRow) -> list[int] | None:
        """The draft's tokens its cache lacks (``propose`` fed all but the last), or None when
        the cache is not as ``propose`` left it."""
        return draft.tokens[-1:] if self.runner.lengths[row.slot] == self._base[row.slot] + draft.size - 1 else None

    def _rollback(self, row: CommitRow, base: int, k: int, ahead) -> int | None:
        """The cache length to keep after a step that drafted k from ``base`` (None: as it is):
        the committed prefix it holds — all but the last draft token were fed."""
        return base + min(row.num_accepted, k - 1)

    def commit(self, rows: Sequence[CommitRow]) -> None:
        for row in rows:
            ahead = self._ahead.pop(row.slot, None)
            base = self._base.pop(row.slot, None)
            if base is None:  # rows it did not draft for this step keep their cache
                continue
            k = self._k.pop(row.slot)
            if ahead is not None and list(row.tokens) == ahead[0]:  # the guess came true:
                self._base[row.slot], self._k[row.slot] = ahead[1], ahead[2]  # the next draft is made
            else:
                length = self._rollback(row, base, k, ahead)
                if length is not None:
                    self.runner.set_length(row.slot, length)

    def release(self, slot: int) -> None:
        self.runner.reset(slot)
        self._base.pop(slot, None)
        self._k.pop(slot, None)
        self._ahead.pop(slot, None)


register_method(MethodSpec(
    name="draft",
    options=DraftOptions,
    build=lambda ctx: DraftModelProposer(ctx.resource, ctx.vocab_size),
    placement="worker",
    checkpoint="draft",
    recipe="specray.training.draft_distill",
    requirement="a draft model (EngineConfig.draft)",
    load=lambda path, ctx: ctx.runner_for(path),
    inspect=lambda path, target: causal_lm_facts(path),
))
register_alias("draft_model", "draft")  # vLLM's name
