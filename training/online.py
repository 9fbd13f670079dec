"""One round of online learning: fine-tune a copy of the serving drafter on captured traffic
with its method's own recipe, measure it against the serving version on held-out recent
traffic by the engine's own measure, and publish it only if it is better.

* **Data**: traces of served requests (``engine/capture.py``), oldest first; the most recent
  ``holdout`` share is held out for the gate, the rest is trained on.
* **Train** (the method's recipe and loss, ``optimise`` from ``training/base.py``: one loop):
  the draft model with OSD's loss on the captured top-k teacher (``training/draft_distill.py``);
  EAGLE with its own loss over windows of the captured features (``training/eagle.py``);
  EAGLE-3 with its training-time test over windows of the captured taps, labelled by the
  captured teacher (``training/eagle3.py``); Medusa's heads and ReDrafter's RNN with their
  cross-entropy on the target's tokens after each captured feature (``training/medusa.py``,
  ``training/redrafter.py``). The teacher of a request is the target's top-k at the temperature
  it was served at; greedy requests' at ``greedy_temperature`` (``training/draft_distill.py``).
* **Gate** (``replay``): the method's own proposer, built as the engine builds it, drafts along
  each held-out request's recorded continuation, step by step, and greedy acceptance (token
  match, ``kernels/tree_acceptance.py``) against the target's recorded tokens decides what is
  accepted — the engine's mean accepted length (1 + accepted / drafts) on that traffic, exact
  for greedy requests (the target's tokens are the recorded ones) and a token-match proxy for
  sampled ones. Serving and candidate versions run on the same traces; the candidate is
  published only if it accepts more (by ``min_gain``). Both share the serving tree and step
  cost, so tokens/s move with the accepted length.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from specray.engine.capture import Trace, capture_kind
from specray.engine.drafter_versions import Blueprint, DrafterVersion, weights_module
from specray.engine.runner import ModelRunner
from specray.kernels.tree_acceptance import tree_greedy_accept
from specray.policies.base import CommitRow, PrefillRow, ProposalRow
from specray.policies.registry import ProposerContext, method_spec
from specray.training.base import SequenceSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundConfig:
    """steps/lr/batch_size: the recipe's optimiser; holdout: share of the newest traces kept for
    the gate (at least ``min_holdout`` traces); min_gain: relative gain in mean accepted length
    the candidate must show; gate_options: the method's request options the gate drafts with
    (default: the method's own defaults, e.g. k = 4 for the draft model); greedy_temperature:
    the teacher's temperature for greedy requests (draft model, EAGLE-3)."""

    steps: int = 40
    lr: float = 1e-3
    batch_size: int = 8
    holdout: float = 0.25
    min_holdout: int = 4
    min_gain: float = 0.01
    gate_options: dict = field(default_factory=dict)
    seed: int = 0
    greedy_temperature: float = 0.25


@dataclass
class RoundResult:
    method: str
    published: bool
    serving: dict  # the gate's measure of the serving version
    candidate: dict
    train_traces: int
    held_out_traces: int
    seconds: float
    loss: float
    state: dict | None = None  # the candidate's weights, when published

    def describe(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "state"}


# -- building a drafter as the engine does ---------------------------------------------------
class _Target:
    """What a proposer reads of the target when it binds to it (a head's embedding and LM head)."""

    def __init__(self, bp: Blueprint):
        self.decoder = nn.Module()
        self.decoder.embed_tokens = nn.Embedding.from_pretrained(bp.embed, freeze=True)
        self.decoder.get_input_embeddings = lambda: self.decoder.embed_tokens
        self.lm_head = nn.Linear(bp.embed.shape[1], bp.lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(bp.lm_head, requires_grad=False)
        self.hidden_size, self.num_layers, self.vocab_size = bp.embed.shape[1], bp.target_layers, bp.vocab_size
        self.device, self.dtype = torch.device("cpu"), torch.float32


def proposer_for(bp: Blueprint, module: nn.Module, num_slots: int, capacity: int):
    """The method's proposer over ``module`` (a copy: the runner takes it over), built by its spec."""
    spec = method_spec(bp.method)
    module = copy.deepcopy(module)
    runner_for = lambda m, extra_capacity=0, shift=0: ModelRunner(m, num_slots, capacity + extra_capacity)  # noqa: E731
    target = _Target(bp) if bp.embed is not None else None
    resource = runner_for(module) if target is None else module
    ctx = ProposerContext(bp.vocab_size, num_slots, capacity, target=target, resource=resource, runner_for=runner_for)
    return spec.build(ctx)


def with_state(bp: Blueprint, state: dict | None) -> nn.Module:
    module = copy.deepcopy(bp.module)
    if state is not None:
        weights_module(module).load_state_dict(state)
    return module


# -- the gate ----------------------------------------------------------------------------------
@torch.inference_mode()
def replay(proposer, traces: Sequence[Trace], options, features: bool) -> dict:
    """The engine's mean accepted length of ``proposer`` drafting along ``traces``' recorded
    continuations (greedy acceptance against the recorded tokens), and the acceptance rate
    per draft position (P(accepted | the one before accepted))."""
    drafts = accepted = 0
    reached: list[int] = []
    hits: list[int] = []
    pos = {}
    if features:
        proposer.prefill([PrefillRow(i, t.tokens[: t.prompt_len], t.tokens[t.prompt_len],
                                     t.features[: t.prompt_len]) for i, t in enumerate(traces)])
    for i, t in enumerate(traces):
        pos[i] = t.prompt_len + 1  # committed: the prompt and the first token (prefill's)
    while True:
        active = [i for i in pos if pos[i] < len(traces[i].tokens)]
        if not active:
            break
        rows = [ProposalRow(i, traces[i].tokens[: pos[i]], min(_k(options), len(traces[i].tokens) - pos[i] - 1),
                            options=options) for i in active]
        drafted = [r for r in rows if r.num_tokens > 0]
        made = dict(zip([r.slot for r in drafted], proposer.propose(drafted).rows if drafted else []))
        commits = []
        for row in rows:
            i, t, p = row.slot, traces[row.slot], pos[row.slot]
            d = made.get(i)
            if d is not None and d.size:
                tree = d.structure
                depth = tree.depth.tolist()
                best = [t.tokens[p + depth[n]] if p + depth[n] < len(t.tokens) else -1 for n in range(tree.size)]
                res = tree_greedy_accept(tree, [t.tokens[p - 1]] + list(d.tokens), best)
                n, path, emitted = len(res.path) - 1, res.path, res.emitted
                drafts += 1
                accepted += n
                for j in range(min(n + 1, max(depth))):
                    if j >= len(reached):
                        reached.append(0)
                        hits.append(0)
                    reached[j] += 1
                    hits[j] += j < n
            else:
                n, path, emitted = 0, [0], [t.tokens[p]]
            feats = t.features[p - 1 : p + n] if features else None
            commits.append(CommitRow(i, emitted, path, feats))
            pos[i] = p + n + 1
        proposer.commit(commits)
    for i in pos:
        proposer.release(i)
    rates = [h / r for h, r in zip(hits, reached) if r]
    return {"mean_accepted_length": 1.0 + accepted / drafts if drafts else 1.0, "drafts": drafts, "rates": rates}


def _k(options) -> int:
    budget = getattr(options, "budget", None)
    return budget if budget is not None else 64  # trees: the proposer cuts to its tree


def measure(bp: Blueprint, module: nn.Module, traces: Sequence[Trace], options: dict) -> dict:
    """``replay`` of the method's proposer over ``module`` on ``traces``."""
    spec = method_spec(bp.method)
    capacity = max(len(t.tokens) for t in traces) + 8
    proposer = proposer_for(bp, module, len(traces), capacity)
    return replay(proposer, traces, spec.options.model_validate({**options, "method": bp.method}),
                  capture_kind(bp.method) == "features")


# -- the recipes ------------------------------------------------------------------------------
WINDOW = 64  # positions per window (EAGLE, EAGLE-3); Medusa and ReDrafter take batch_size x WINDOW positions


def _sequences(traces: Sequence[Trace], last_feature: bool = False) -> SequenceSet:
    """Traces as the recipes' ``SequenceSet``: tokens [N, T] right-padded, the captured features
    [N, T, F] (a trace has none at its last position: zero there), and lengths — each trace's
    tokens, or one less with ``last_feature`` (a recipe that reads the feature after a token)."""
    n, width = len(traces), max(len(t.tokens) for t in traces)
    tokens = torch.zeros(n, width, dtype=torch.long)
    feats = torch.zeros(n, width, traces[0].features.shape[1])
    for i, t in enumerate(traces):
        tokens[i, : len(t.tokens)] = torch.tensor(t.tokens)
        feats[i, : len(t.tokens) - 1] = t.features[: len(t.tokens) - 1]
    lengths = torch.tensor([len(t.tokens) - last_feature for t in traces])
    return SequenceSet(tokens, feats, lengths, torch.tensor([t.prompt_len for t in traces]))


def _teachers(traces: Sequence[Trace], cfg: RoundConfig):
    """The captured teacher (top-k at verified positions), at each request's temperature
    (greedy ones at ``cfg.greedy_temperature``)."""
    from specray.training.draft_distill import TeacherSet, teacher_temperature

    return TeacherSet.from_rows([(t.tokens, t.prompt_len, t.topk_ids, t.topk_logprobs) for t in traces],
                                [teacher_temperature(t.temperature, cfg.greedy_temperature) for t in traces])


def _fine_tune(module: nn.Module, loss_at, cfg: RoundConfig, desc: str, clip: float) -> float:
    from specray.training.base import optimise

    module.train()
    loss = optimise(module.parameters(), loss_at, cfg.steps, cfg.lr, desc, clip=clip)
    module.eval()
    return loss


def _train_draft(module, traces: Sequence[Trace], cfg: RoundConfig, gen, bp: Blueprint) -> float:
    """OSD (``training/draft_distill.py``): forward KL from the captured teacher."""
    from specray.training.draft_distill import osd_loss

    data = _teachers(traces, cfg)
    module.set_attn_implementation("sdpa")
    return _fine_tune(module, lambda step: osd_loss(module, data, cfg.batch_size, gen), cfg, "online draft (OSD)", 1.0)


def _train_eagle(module, traces: Sequence[Trace], cfg: RoundConfig, gen, bp: Blueprint) -> float:
    """EAGLE's loss (``training/eagle.py``) over windows of the captured features: the next
    feature and the target's next-token distribution through its LM head."""
    from specray.training.eagle import eagle_loss, windows

    data = _sequences(traces, last_feature=True)
    module.bind(nn.Embedding.from_pretrained(bp.embed, freeze=True), _Target(bp).lm_head)
    window = min(WINDOW, int(data.lengths.max()) - 1)
    try:
        return _fine_tune(module, lambda step: eagle_loss(module, bp.lm_head, windows(data, cfg.batch_size, window, gen),
                                                          0.1, 1.0), cfg, "online eagle head", 0.5)
    finally:
        module._target = ()  # unbound again, as the blueprint keeps it


def _train_eagle3(module, traces: Sequence[Trace], cfg: RoundConfig, gen, bp: Blueprint) -> float:
    """EAGLE-3's training-time test (``training/eagle3.py``) over windows of the captured taps,
    labelled with the captured teacher (the target's top-k at the request's temperature,
    renormalised over the draft vocabulary)."""
    from specray.training.eagle3 import DECAY, eagle3_loss, window_index

    data = _sequences(traces)
    labels = teacher_labels(module, _teachers(traces, cfg))
    module.bind(nn.Embedding.from_pretrained(bp.embed, freeze=True), bp.target_layers)
    window = min(WINDOW, int(data.lengths.max()) - 1)
    try:
        return _fine_tune(module, lambda step: eagle3_loss(module, labels, data, data.features,
                                                           window_index(data, cfg.batch_size, window, gen),
                                                           EAGLE3_UNROLL, DECAY), cfg, "online eagle3 head", 0.5)
    finally:
        module._embed = ()


EAGLE3_UNROLL = 7  # EAGLE-3's passes of the training-time test


def teacher_labels(head, teachers):
    """EAGLE-3's labels (``training/eagle3.py``'s ``feature_labels``) from a captured
    ``TeacherSet``: the target's top-k at a position, at the trace's teacher temperature,
    restricted to the draft vocabulary and renormalised; inside: the position has a teacher
    whose top token lies in the draft vocabulary."""
    from specray.training.draft_distill import teacher

    draft_id = torch.full((head.vocab_size,), -1, dtype=torch.long)
    draft_id[head.target_ids] = torch.arange(head.draft_vocab_size)

    def labels(rows: torch.Tensor, pos: torch.Tensor):  # [B, W] each
        ids = draft_id[teachers.top_ids[rows, pos]]  # [B, W, k] draft ids, -1 outside
        p = teacher(teachers.top_lp[rows, pos], teachers.temperature[rows]) * (ids >= 0)  # [B, W, k]
        out = torch.zeros(*rows.shape, head.draft_vocab_size).scatter_add_(-1, ids.clamp(min=0), p)
        out = out / out.sum(-1, keepdim=True).clamp(min=1e-12)
        return out, teachers.valid[rows, pos] & (ids[..., 0] >= 0)

    return labels


def _train_medusa(module, traces: Sequence[Trace], cfg: RoundConfig, gen, bp: Blueprint) -> float:
    """Medusa's loss (``training/medusa.py``): head k learns the target's token k + 2 ahead of
    each continuation position's captured feature."""
    from specray.training.medusa import head_examples, heads_loss

    feats, labels = head_examples(_sequences(traces), module.num_heads)
    return _fine_tune(module, heads_loss(module, feats, labels, cfg.batch_size * WINDOW, gen), cfg,
                      "online medusa heads", 1.0)


def _train_redrafter(module, traces: Sequence[Trace], cfg: RoundConfig, gen, bp: Blueprint) -> float:
    """ReDrafter's loss (``training/redrafter.py``): from each continuation position's captured
    feature, the RNN over the target's next tokens learns each next one (teacher forcing), over
    as many levels as the served beams draft."""
    from specray.training.redrafter import windows_loss

    options = method_spec("redrafter").options.model_validate({**cfg.gate_options, "method": "redrafter"})
    loss_at = windows_loss(module, bp.embed, _sequences(traces), options.draft_len_per_beam, cfg.batch_size * WINDOW,
                           gen)
    return _fine_tune(module, loss_at, cfg, "online redrafter", 1.0)


TRAINERS = {"draft": _train_draft, "eagle": _train_eagle, "eagle3": _train_eagle3, "medusa": _train_medusa,
            "redrafter": _train_redrafter}


def trainable(method: str) -> bool:
    return method in TRAINERS


def train_round(bp: Blueprint, serving: DrafterVersion | None, traces: Sequence[Trace],
                cfg: RoundConfig | dict | None = None) -> RoundResult:
    """Train a candidate from the serving version on ``traces`` (oldest first) and gate it
    (``cfg``: a ``RoundConfig`` or its fields; the learner actor passes them by name)."""
    cfg = cfg if isinstance(cfg, RoundConfig) else RoundConfig(**(cfg or {}))
    if bp.method not in TRAINERS:
        raise ValueError(f"online training of {bp.method!r} is not implemented (trainable: {sorted(TRAINERS)})")
    start = time.time()
    traces = sorted(traces, key=lambda t: t.finished_at)
    n_hold = max(cfg.min_holdout, int(round(len(traces) * cfg.holdout)))
    if len(traces) < n_hold + 1:
        raise ValueError(f"{len(traces)} traces: too few to train on and hold {n_hold} out")
    train, held = traces[:-n_hold], traces[-n_hold:]
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    base = with_state(bp, serving.state if serving is not None else None)
    candidate = copy.deepcopy(base)
    fit = TRAINERS[bp.method]
    loss = fit(candidate, train, cfg, gen, bp)
    now = measure(bp, base, held, cfg.gate_options)
    new = measure(bp, candidate, held, cfg.gate_options)
    better = new["mean_accepted_length"] > now["mean_accepted_length"] * (1 + cfg.min_gain)
    state = {k: v.detach().cpu().clone() for k, v in weights_module(candidate).state_dict().items()} if better else None
    return RoundResult(bp.method, better, now, new, len(train), len(held), round(time.time() - start, 2), loss, state)
