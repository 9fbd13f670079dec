"""EAGLE-1 and EAGLE-2: a feature-level draft head that runs autoregressively on the
target's features, expanding a token tree level by level.

The head (EAGLE; Li et al. 2024): ``f̂_{t+1} = layer(fc([embed(x_{t+1}); f_t]))`` — the
target's frozen token embedding, a projection 2H -> H, one Llama decoder layer without its
input norm — and logits ``lm_head(f̂)`` through the target's frozen LM head. ``f_t`` is the
target's final-norm hidden state at position t (the input of its LM head).

The head has its own KV cache per slot (a ``ModelRunner`` over the head, same slots as the
target): position t holds the pair (f_t, x_{t+1}) for every committed token, built from
the target's *true* features, which every commit hands over for every accepted token
(``CommitRow.features``; prompt features come with ``PrefillRow``). A step:

1. catch up: the pairs committed since the last step go through the head in one ragged
   forward; the output at the last one, f̂ of the new root, gives the first level;
2. expand: level by level, the nodes chosen for expansion are fed with their parent's
   predicted feature under a tree mask (one head forward per depth; the head's cache is
   rolled back to the committed pairs after each, an integer), and each proposes children:
   * EAGLE-1 (``dynamic_tree: false``): a static tree (``eagle_choices``/``tree``, default
     the tree saved with the head): the children of a node are the head's top-ranked
     tokens (greedy rows) or draws without replacement from the head's distribution under
     the request's sampling settings (sampled rows; each node then carries the q it was
     drawn from, so tree rejection sampling uses the head's probabilities);
   * EAGLE-2 (``dynamic_tree: true``): each expanded node proposes its ``top_k`` children,
     scored by the product of the head's probabilities along the path; the global ``top_k``
     of each level are expanded next, ``depth`` times; the ``total_tokens - 1`` best
     nodes form the tree (a child never scores above its parent, so parents come along).
     Candidates are chosen by confidence, so they are deterministic proposals (one-hot q)
     — the exact rule for any selection (EAGLE-2's own).
3. the target verifies the tree in one forward; the accepted path's true features are the
   next commit.

Checkpoints use the public EAGLE layout (SafeAILab/EAGLE, read by vLLM and SGLang):
``config.json`` of a one-layer Llama (plus ``bias`` for fc), weights ``fc.weight``,
``fc.bias``, ``layers.0.self_attn.*``, ``layers.0.mlp.*``,
``layers.0.post_attention_layernorm.weight`` (and ``embed_tokens.weight``, which specray
does not use: the target's embedding is), in ``model.safetensors`` or
``pytorch_model.bin``. specray adds ``eagle_choices`` (a fitted default tree) to config.json.
"""

from __future__ import annotations

import json
import math
import pathlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Literal, Sequence

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from specray.kernels.sampling import probs_from_logits
from specray.kernels.tree import NAMED_TREES, TokenTree, build_tree, normalize_choices
from specray.policies.checkpoint_files import building, load_weights, read_json_config, read_tensors
from specray.policies.base import CommitRow, DeviceDraft, Draft, DraftRow, PrefillRow, ProposalRow
from specray.policies.eagle_device import dynamic_growth
from specray.policies.registry import MethodSpec, TreeAcceptanceOptions, register_method

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# EAGLE's own default static tree (SafeAILab/EAGLE choices.py, mc_sim_7b_63): 25 nodes, depth 5.
MC_SIM_7B_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
                [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
                [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
EAGLE_TREES = {**NAMED_TREES, "mc_sim_7b_63": MC_SIM_7B_63}
DEFAULT_TREE = "mc_sim_7b_63"
MAX_DEPTH = 16


class EagleOptions(TreeAcceptanceOptions):
    """EAGLE-1 (a static tree) or EAGLE-2 (``dynamic_tree``: a tree per row and step)."""

    method: Literal["eagle"] = "eagle"
    dynamic_tree: bool = Field(False, description="EAGLE-2: expand by the head's confidence (top_k, depth, total_tokens).")
    eagle_choices: list[list[int]] | None = Field(
        None, description="EAGLE-1's static tree: every candidate, or only the unique paths (as medusa_choices)."
    )
    tree: str | None = Field(None, description=f"EAGLE-1: a named tree ({', '.join(EAGLE_TREES)}).")
    top_k: int = Field(8, ge=1, le=32, description="EAGLE-2: children per expanded node, and nodes expanded per depth.")
    depth: int = Field(5, ge=1, le=MAX_DEPTH, description="EAGLE-2: expansion depth.")
    total_tokens: int = Field(24, ge=2, le=256, description="EAGLE-2: tokens verified per step (root included).")

    @field_validator("eagle_choices")
    @classmethod
    def _valid_tree(cls, v):
        if v is not None:
            normalize_choices(v, max_depth=MAX_DEPTH)
        return v

    @field_validator("tree")
    @classmethod
    def _known_tree(cls, v):
        if v is not None and v not in EAGLE_TREES:
            raise ValueError(f"unknown tree {v!r}; named trees: {sorted(EAGLE_TREES)}")
        return v

    @model_validator(mode="after")
    def _one_kind(self):
        if self.dynamic_tree and (self.eagle_choices is not None or self.tree is not None):
            raise ValueError("dynamic_tree builds its own tree: give eagle_choices/tree only with dynamic_tree false")
        return self


# -- the head ------------------------------------------------------------------------------
class EagleHead(nn.Module):
    """fc + one decoder layer; the target's embedding and LM head are bound, not owned.

    It presents the decoder surface a ``ModelRunner`` drives (``get_decoder``: embed_tokens,
    rotary_emb, layers, norm; ``get_output_embeddings``), so the head gets a slot-indexed KV
    cache, tree masks and integer rollback from the same runner the target uses.
    """

    def __init__(self, config, bias: bool = True):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        layer = LlamaDecoderLayer(config, 0)
        layer.input_layernorm = nn.Identity()  # EAGLE's first layer has no input norm
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.norm = nn.Identity()  # f̂ is compared with the target's final-norm features
        self.choices: list[list[int]] | None = None
        # EAGLE-2 confidence for greedy rows: softmax(logits / greedy_temperature) estimates
        # P(the target's argmax is this token). The head is trained on the target's whole
        # distribution, which is flatter than "is it the argmax" (what greedy acceptance
        # asks), so under the raw probabilities deep nodes look worse than they are and the
        # dynamic tree comes out too shallow. Fitted on held-out data at training (temperature
        # scaling, Guo et al. 2017); 1.0 (EAGLE-2's raw probabilities) for heads without it.
        self.greedy_temperature = 1.0
        self._target = ()  # (embed_tokens, lm_head) of the target: bound, not parameters

    # The decoder surface a ModelRunner reads.
    @property
    def embed_tokens(self):
        return self._target[0]

    @property
    def lm_head(self):
        return self._target[1]

    def get_decoder(self):
        return self

    def get_output_embeddings(self):
        return self.lm_head

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "EagleHead":
        """Use the target's (frozen) token embedding and LM head."""
        if embed_tokens.weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"the EAGLE head has hidden size {self.config.hidden_size}, "
                             f"the target {embed_tokens.weight.shape[1]}")
        self._target = (embed_tokens, lm_head)
        return self

    def fuse(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(tokens); features]): [..., H] head inputs."""
        emb = self.embed_tokens(tokens).to(features.dtype)
        return self.fc(torch.cat([emb, features], dim=-1))

    # EAGLE-1 reads the target's features and its own predicted ones the same way (EAGLE-3 does not).
    fuse_target = fuse

    def target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as ``fuse`` reads them ([.., H]: EAGLE-1's as they are)."""
        return features

    def forward_sequence(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Training/eval: f̂ [B, T, H] for pairs (features[:, t], tokens[:, t]) (causal, no cache)."""
        hidden = self.fuse(tokens, features)
        pos = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
        rope = self.rotary_emb(hidden, position_ids=pos)
        impl = self.config._attn_implementation
        self.config._attn_implementation = "sdpa"
        try:
            mask = torch.full((tokens.shape[1],) * 2, float("-inf"), device=hidden.device).triu(1)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=mask[None, None].to(hidden.dtype), position_embeddings=rope,
                               position_ids=pos)
        finally:
            self.config._attn_implementation = impl
        return hidden

    # -- the public checkpoint layout --------------------------------------------------------
    def save(self, directory: str | pathlib.Path, base_model: str | None = None) -> None:
        cfg = self.config.to_dict()
        cfg.update({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "bias": self.fc.bias is not None,
                    "base_model_name_or_path": base_model})
        state = dict(self.state_dict())
        if self._target:  # the public layout carries the embedding; specray reads the target's
            state["embed_tokens.weight"] = self.embed_tokens.weight.detach()
        write_head_dir(directory, cfg, state, self)

    @classmethod
    def load(cls, directory: str | pathlib.Path, hidden_size: int | None = None,
             described: bool = False) -> "EagleHead":
        """A head from the public layout (``described``: only checked, see checkpoint_files)."""
        raw, cfg_file = read_head_config(directory, "EAGLE head")
        if hidden_size is not None and raw["hidden_size"] != hidden_size:
            raise ValueError(f"the EAGLE head expects hidden size {raw['hidden_size']}, the target has {hidden_size}")
        state, weights = read_head_weights(directory, described)
        state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
        with building(described):
            head = cls(llama_config(raw), bias=bool(raw.get("bias", "fc.bias" in state)))
        load_weights(head, state, described, f"{weights} does not match a one-layer EAGLE head of {cfg_file}")
        read_extras(head, raw, cfg_file)
        return head.eval()


# -- checkpoint files shared by the EAGLE heads (EAGLE-1/2 here, EAGLE-3 in eagle3.py) ------
SPECRAY_KEYS = ("eagle_choices", "greedy_temperature")  # specray's additions to config.json


def read_head_config(directory: str | pathlib.Path, what: str) -> tuple[dict, pathlib.Path]:
    """A head directory's config.json (a one-layer Llama's), or a typed error naming what is wrong."""
    raw, cfg_file = read_json_config(directory, f"an {what}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if k not in raw]
    if missing:
        raise ValueError(f"{cfg_file} lacks {missing}: not a Llama-layer {what} config")
    return raw, cfg_file


def read_head_weights(directory: str | pathlib.Path, described: bool = False) -> tuple[dict, pathlib.Path]:
    """A head directory's tensors (model.safetensors or pytorch_model.bin; ``model.`` prefixes dropped)."""
    state, weights = read_tensors(directory, WEIGHT_FILES, described)
    return {k.removeprefix("model."): v for k, v in state.items()}, weights


def llama_config(raw: dict, drop: Sequence[str] = ("bias",)):
    """The head's one-layer LlamaConfig from its config.json (specray's keys and ``drop`` left out)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**{k: v for k, v in raw.items() if k not in (*SPECRAY_KEYS, *drop)}, "num_hidden_layers": 1})


def read_extras(head, raw: dict, cfg_file) -> None:
    """specray's keys: the fitted default tree and the greedy-rows confidence temperature."""
    if raw.get("eagle_choices") is not None:
        try:
            build_tree(raw["eagle_choices"], max_depth=MAX_DEPTH)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{cfg_file}: bad eagle_choices: {exc}") from None
        head.choices = raw["eagle_choices"]
    tau = raw.get("greedy_temperature", 1.0)
    if not isinstance(tau, (int, float)) or not 0 < tau <= 100:
        raise ValueError(f"{cfg_file}: greedy_temperature must be a positive number, got {tau!r}")
    head.greedy_temperature = float(tau)


def write_head_dir(directory: str | pathlib.Path, cfg: dict, state: dict, head) -> None:
    """config.json (with specray's keys) and model.safetensors."""
    from safetensors.torch import save_file

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in cfg.items() if k != "_attn_implementation"}
    if head.choices is not None:
        cfg["eagle_choices"] = head.choices
    cfg["greedy_temperature"] = head.greedy_temperature
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / WEIGHT_FILES[0]))


# -- drafting ------------------------------------------------------------------------------
def resolve_tree(options: EagleOptions, head_choices=None) -> TokenTree:
    """EAGLE-1's tree: explicit choices, a named tree, the head's own, else mc_sim_7b_63."""
    choices = options.eagle_choices
    if choices is None and options.tree:
        choices = EAGLE_TREES[options.tree]
    if choices is None:
        choices = head_choices if head_choices is not None else EAGLE_TREES[DEFAULT_TREE]
    return build_tree(choices, max_depth=MAX_DEPTH)


@dataclass
class _Node:
    token: int
    parent: int  # index into the row's node list; -1 = the root
    depth: int
    score: float  # log of the product of the head's probabilities along the path
    q: torch.Tensor | None = None  # [V] the distribution it was drawn from (sampled static rows)
    rank: tuple = ()  # static trees: the rank path (a choice)
    feature: torch.Tensor | None = None  # f̂ the head predicted at this node (once fed)


class _RowPlan:
    """One row's tree under construction."""

    def __init__(self, row: ProposalRow, tree: TokenTree | None, room: int):
        self.row, self.tree, self.room = row, tree, room
        self.nodes: list[_Node] = []
        self.frontier: list[int] = []  # nodes to expand at the next level
        self.root_feature: torch.Tensor | None = None  # f̂ at the root (from the catch-up)
        if tree is not None:
            self.depth = min(tree.max_depth, room)  # deeper nodes could never be kept
        else:  # EAGLE-2: its levels, nodes kept, and children per node / nodes expanded per level
            self.depth, self.budget, self.width = dynamic_growth(row.options, room)
        self.sampled = tree is not None and not row.sampling.greedy


class EagleProposer:
    def __init__(self, head: EagleHead, runner, vocab_size: int):
        self.head, self.runner, self.vocab_size = head, runner, vocab_size
        self._pending: dict[int, tuple[list[torch.Tensor], list[int]]] = {}  # slot -> (features, next tokens)

    # -- what the target tells us ------------------------------------------------------------
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        for row in rows:
            # A row that starts from a cached prefix (``row.start`` > 0) was attached to the
            # head's cached blocks of it by the engine, which then computed the target's
            # features from there on.
            if not row.start:
                self.runner.reset(row.slot)
            self._pending[row.slot] = ([row.features], list(row.token_ids[row.start + 1 :]) + [row.first_token])
        if self._caches_prefixes:
            self._feed_prompts(rows)

    @property
    def _caches_prefixes(self) -> bool:
        blocks = getattr(self.runner, "blocks", None)
        return blocks is not None and blocks.pool.prefix_caching

    @torch.inference_mode()
    def _feed_prompts(self, rows: Sequence[PrefillRow]) -> None:
        """Run the head over each prompt now, all but its last pair (the next draft's root): its
        cache then holds the prompt's blocks when the engine publishes them, so a later request
        with the same prefix finds them even if this one never drafted (the self-tuning length
        can keep a request's drafting off throughout; a head that never ran held no blocks, and
        the next request's cached prefix, the shorter of the target's and the head's, was
        empty)."""
        slots, embeds, tokens, roots = [], [], [], []
        for row in rows:
            feats, toks = self._pending[row.slot]
            if len(toks) < 2:
                continue
            f = torch.cat(feats).to(self.runner.dtype)
            t = torch.tensor(toks[:-1], device=f.device)
            slots.append(row.slot)
            embeds.append(self.head.fuse_target(t, f[:-1]))
            tokens.append(toks[:-1])
            roots.append(([f[-1:]], toks[-1:]))
        if slots:
            self.runner.forward(slots, tokens, embeds=embeds)
            self._pending.update(zip(slots, roots))  # only once fed: a failed forward leaves them pending

    def commit(self, rows: Sequence[CommitRow]) -> None:
        for row in rows:
            feats, toks = self._pending.setdefault(row.slot, ([], []))
            feats.append(row.features)
            toks.extend(row.tokens)

    def release(self, slot: int) -> None:
        self.runner.reset(slot)
        self._pending.pop(slot, None)

    # -- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if not rows:
            return Draft([])
        with self._undone_on_error(rows):
            return self._propose(rows)

    def _propose(self, rows: Sequence[ProposalRow]) -> Draft:
        root_feature, root_logits = self._catch_up(rows)  # [B, H], [B, V]
        plans = []
        for i, row in enumerate(rows):
            tree = None if row.options.dynamic_tree else resolve_tree(row.options, self.head.choices)
            plans.append(_RowPlan(row, tree, row.num_tokens))
            plans[-1].root_feature = root_feature[i]
        for level in range(1, max(p.depth for p in plans) + 1):
            if level == 1:
                parents, logits = [[-1] for _ in plans], [root_logits[i : i + 1] for i in range(len(plans))]
            else:
                parents, logits = self._expand(plans)
            growing = [(plan, par, lg) for plan, par, lg in zip(plans, parents, logits) if level <= plan.depth and par]
            scored = [self._scores(plan, par, lg) for plan, par, lg in growing]
            tops = _read_topk([(logp, width) for (plan, _, _), (logp, width) in zip(growing, scored)
                               if width and not plan.sampled])
            for (plan, par, lg), (logp, width) in zip(growing, scored):
                top = None if plan.sampled or not width else next(tops)
                self._children(plan, level, par, lg, logp, width, top)
        return Draft([self._finish(p) for p in plans])

    @torch.inference_mode()
    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft | None:
        """Every row's tree grown on the device, tokens and (EAGLE-2) structure never leaving
        it (``policies/eagle_device.py``): static and dynamic trees, greedy and sampled rows.
        None — the host path — when the head has no fixed-shape forward."""
        if not rows or self.runner.static is None:
            return None
        from specray.policies.eagle_device import grow_on_device

        with self._undone_on_error(rows):
            return grow_on_device(self, rows, lambda r: resolve_tree(r.options, self.head.choices))

    @contextmanager
    def _undone_on_error(self, rows: Sequence[ProposalRow]):
        """A draft that raises leaves its rows as they were — their committed pairs still
        pending, the head's cache at its length before the catch-up — so the executor's
        row-by-row retry drafts them again (else every row of the batch failed: its pairs
        were gone)."""
        saved = {r.slot: (self._pending.get(r.slot), self.runner.lengths[r.slot]) for r in rows}
        try:
            yield
        except BaseException:
            for slot, (pending, length) in saved.items():
                if pending is not None:
                    self._pending[slot] = pending
                self.runner.set_length(slot, length)
            raise

    def _catch_up(self, rows):
        """Feed each row's committed pairs; f̂ and logits at its last one (the new root)."""
        slots, embeds, tokens = [], [], []
        for row in rows:
            feats, toks = self._pending.pop(row.slot, ([], []))
            if not toks:
                raise ValueError(f"eagle: no committed features for slot {row.slot} (missing prefill/commit)")
            f = torch.cat(feats).to(self.runner.dtype)
            t = torch.tensor(toks, device=f.device)
            slots.append(row.slot)
            embeds.append(self.head.fuse_target(t, f))  # the target's features
            tokens.append(toks)
        out = self.runner.forward(slots, tokens, embeds=embeds)
        return out.hidden[:, 0], out.logits[:, 0]

    def _scores(self, plan: _RowPlan, parents: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The head's log-probabilities below ``parents`` [len(parents), V] and how many
        children each parent may get (0: none)."""
        # EAGLE-2 scores greedy rows with the head's calibrated confidence (see greedy_temperature)
        calibrate = plan.tree is None and plan.row.sampling.greedy
        scale = self.head.greedy_temperature if calibrate else 1.0
        logp = torch.log_softmax(logits.float() / scale, dim=-1)  # [P, V]
        if plan.tree is None:
            return logp, plan.width
        kids = _kids_by_rank(plan.tree.choices)
        # as many candidates as the highest rank asked for: a fitted tree may skip ranks ([2]
        # without [1]); reading one per child lost every node past the first gap
        return logp, max((kids[r][-1][-1] + 1 for r in map(lambda p: self._rank(plan, p), parents) if r in kids),
                         default=0)

    def _children(self, plan: _RowPlan, level: int, parents: list[int], logits: torch.Tensor, logp: torch.Tensor,
                  width: int, top: tuple[list, list] | None) -> None:
        """Add level ``level``'s nodes below ``parents`` (their logits and log-probabilities
        [len(parents), V]; ``top``: each parent's ``width`` best (indices, values) as lists,
        read for every row at once by ``_read_topk``; None for sampled rows)."""
        new: list[int] = []
        if plan.tree is not None:  # static: each parent's children are given by the tree's ranks
            kids = _kids_by_rank(plan.tree.choices)
            if width == 0:
                plan.frontier = []
                return
            if not plan.sampled:
                top_idx, top_val = top
            for n, p in enumerate(parents):
                ranks = kids.get(self._rank(plan, p), ())
                if not ranks:
                    continue
                base = plan.nodes[p].score if p >= 0 else 0.0
                if plan.sampled:
                    picks, qs = self._pick(plan.row, logits[n], ranks[-1][-1] + 1)
                    vals = logp[n, picks].tolist()
                else:
                    picks, qs, vals = top_idx[n], None, top_val[n]
                for c in ranks:
                    r = c[-1]
                    if r >= len(picks):  # fewer possible tokens than the tree asks for
                        continue
                    plan.nodes.append(_Node(picks[r], p, level, base + vals[r], qs[r] if qs else None, c))
                    new.append(len(plan.nodes) - 1)
            # a static tree expands every node that has children in it
            plan.frontier = [n for n in new if plan.nodes[n].rank in kids] if level < plan.depth else []
        else:  # dynamic: top_k children per expanded node, the best top_k are expanded next
            k = plan.width
            for p, idx, vals in zip(parents, *top):
                base = plan.nodes[p].score if p >= 0 else 0.0
                for tok, val in zip(idx, vals):
                    if val == -math.inf:  # outside a reduced draft vocabulary (EAGLE-3)
                        continue
                    plan.nodes.append(_Node(tok, p, level, base + val))
                    new.append(len(plan.nodes) - 1)
            plan.frontier = sorted(new, key=lambda n: -plan.nodes[n].score)[:k] if level < plan.depth else []

    @staticmethod
    def _rank(plan: _RowPlan, node: int) -> tuple:
        return plan.nodes[node].rank if node >= 0 else ()

    @staticmethod
    def _pick(row: ProposalRow, logits: torch.Tensor, width: int):
        """``width`` draws without replacement from the row's sampling distribution (Gumbel
        top-k), with the distribution each one was drawn from given the ones before it."""
        s = row.sampling
        q = probs_from_logits(logits[None].float(), torch.tensor([s.temperature]), torch.tensor([s.top_k]),
                              torch.tensor([s.top_p]))[0]
        width = min(width, int((q > 0).sum()))
        u = torch.rand(q.shape, generator=row.generator, device=q.device).clamp_(1e-12, 1 - 1e-12)
        keys = torch.where(q > 0, torch.log(q) - torch.log(-torch.log(u)), torch.full_like(q, -math.inf))
        picks = keys.topk(width).indices.tolist()
        qs, left = [], q.clone()
        for tok in picks:
            qs.append(left / left.sum())
            left[tok] = 0
        return picks, qs

    def _expand(self, plans: list[_RowPlan]):
        """One head forward over every row's expanded nodes (re-fed each level, under their
        ancestor mask); returns per row the frontier and its logits [len(frontier), V]."""
        fed = [sorted({a for n in plan.frontier for a in self._ancestors(plan, n)}) for plan in plans]
        active = [i for i, f in enumerate(fed) if f]
        if not active:
            return [[] for _ in plans], [None for _ in plans]
        slots, embeds, tokens, masks, offsets = [], [], [], [], []
        q = max(len(fed[i]) for i in active)
        for i in active:
            plan, nodes = plans[i], fed[i]
            where = {n: j for j, n in enumerate(nodes)}
            toks = torch.tensor([plan.nodes[n].token for n in nodes], device=self.runner.device)
            parent_feats = torch.stack([self._parent_feature(plan, n) for n in nodes])
            mask = np.eye(q, dtype=bool)  # host-side: one tensor per row, not one op per entry
            rows_, cols_ = zip(*((j, where[a]) for j, n in enumerate(nodes) for a in self._ancestors(plan, n)))
            mask[list(rows_), list(cols_)] = True
            off = np.arange(q)
            off[: len(nodes)] = [plan.nodes[n].depth - 1 for n in nodes]
            slots.append(plan.row.slot)
            embeds.append(self.head.fuse(toks, parent_feats.to(self.runner.dtype)))
            tokens.append([plan.nodes[n].token for n in nodes])
            masks.append(mask)
            offsets.append(off)
        base = [self.runner.lengths[s] for s in slots]
        layout = (torch.from_numpy(np.stack(masks)), torch.from_numpy(np.stack(offsets)))
        out = self.runner.forward(slots, tokens, torch.arange(q)[None].expand(len(slots), -1), layout=layout,
                                  embeds=embeds)
        for s, b in zip(slots, base):
            self.runner.set_length(s, b)  # the tree's head KV is never kept
        parents, logits = [[] for _ in plans], [None for _ in plans]
        for j, i in enumerate(active):
            plan, nodes = plans[i], fed[i]
            for col, n in enumerate(nodes):
                plan.nodes[n].feature = out.hidden[j, col]
            cols = [nodes.index(n) for n in plan.frontier]
            parents[i] = list(plan.frontier)
            logits[i] = out.logits[j, cols]
        return parents, logits

    @staticmethod
    def _ancestors(plan: _RowPlan, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = plan.nodes[node].parent
        return out

    def _parent_feature(self, plan: _RowPlan, node: int) -> torch.Tensor:
        parent = plan.nodes[node].parent
        return plan.root_feature if parent < 0 else plan.nodes[parent].feature

    def _finish(self, plan: _RowPlan) -> DraftRow:
        """The nodes to verify, parents first (siblings by rank or score), at most the room.

        A greedy row under a cap (the room: max_tokens, or the self-tuning length) keeps its
        best-scored nodes, as EAGLE-2 keeps its budget: a path's score only falls along it,
        so the set is a subtree, and a cap of k is the head's k likeliest continuations, not
        the first level's k siblings. A sampled static row keeps the first nodes in draw
        order: each sibling's q assumes the ones drawn before it are there."""
        nodes = plan.nodes
        best_first = lambda n: (-nodes[n].score, nodes[n].depth)  # noqa: E731 - ties: the parent first
        if plan.tree is not None:
            chosen = list(range(len(nodes)))
            if not plan.sampled and len(chosen) > plan.room:
                chosen = sorted(chosen, key=best_first)[: plan.room]
            chosen.sort(key=lambda n: (nodes[n].depth, nodes[n].rank))
        else:
            chosen = sorted(range(len(nodes)), key=best_first)[:plan.budget]
            chosen.sort(key=lambda n: (nodes[n].depth, -nodes[n].score))
        chosen = chosen[: plan.room]  # sampled static rows: depth-ordered, so every kept node's parent is kept
        index = {n: i + 1 for i, n in enumerate(chosen)}
        parents = [index.get(nodes[n].parent, 0) if nodes[n].parent >= 0 else 0 for n in chosen]
        tokens = [nodes[n].token for n in chosen]
        probs = torch.stack([nodes[n].q for n in chosen]) if plan.sampled and chosen else None
        return DraftRow(tokens, TokenTree.from_parents(parents), probs)


def _read_topk(jobs) -> "Iterator[tuple[list, list]]":
    """Each job's (logp [P, V], width) top-``width`` (indices, values) per row, as lists: one
    read-back for all of them (a level of every row's tree), not two per row."""
    tops = [logp.topk(min(width, logp.shape[-1])) for logp, width in jobs]
    if not tops:
        return iter(())
    # indices travel as float64 beside the values: exact for any vocabulary size
    flat = torch.cat([torch.cat([t.values.double().flatten(), t.indices.double().flatten()]) for t in tops]).tolist()
    out, at = [], 0
    for t in tops:
        rows, w = t.values.shape
        vals, idx = flat[at : at + rows * w], flat[at + rows * w : at + 2 * rows * w]
        at += 2 * rows * w
        out.append(([[int(i) for i in idx[r * w : (r + 1) * w]] for r in range(rows)],
                    [vals[r * w : (r + 1) * w] for r in range(rows)]))
    return iter(out)


@lru_cache(maxsize=64)
def _kids_by_rank(choices: tuple) -> dict[tuple, list[tuple]]:
    """A static tree's children per node, by rank path (root: ()), in rank order."""
    kids: dict[tuple, list[tuple]] = {}
    for c in choices:
        kids.setdefault(tuple(c[:-1]), []).append(tuple(c))
    for v in kids.values():
        v.sort(key=lambda c: c[-1])
    return kids


def _inspect(path: str, target) -> dict:
    """The head's layout against the target (its embedding and LM head are the target's)."""
    EagleHead.load(path, hidden_size=target.hidden_size, described=True)
    return {}


def _load(path: str, ctx) -> tuple[EagleHead, object]:
    head = EagleHead.load(path, hidden_size=ctx.target.hidden_size)
    return _bind(head, ctx)


def _bind(head: EagleHead, ctx):
    decoder = ctx.target.decoder
    return ctx.place(head.bind(decoder.embed_tokens, ctx.target.lm_head))


def _build(ctx) -> EagleProposer:
    head = _bind(ctx.resource, ctx)  # in-memory heads too: the target's dtype and device
    # The head's cache holds the committed pairs plus one step's expanded nodes.
    runner = head_runner(ctx, head)
    return EagleProposer(head, runner, ctx.vocab_size)


def head_runner(ctx, head):
    """The head's runner: its KV cache holds the committed pairs plus one step's expanded
    nodes; under a fixed-shape step it gets the target's kind of forward (compiled under
    ``compile``), the head's input fusion inside the graph."""
    runner = ctx.runner_for(head, extra_capacity=MAX_DEPTH * 32 + 256, shift=1)  # entry i reads token i + 1
    if ctx.step != "eager":
        runner.enable_static(ctx.step, inputs=head.fuse)
    return runner


def _check(options: EagleOptions, facts: dict, limits) -> None:
    if options.dynamic_tree:
        # (a size asked for must fit; the default is cut to the room a step has, as every tree)
        if "total_tokens" in options.model_fields_set and options.total_tokens > limits.capacity:
            raise ValueError(f"speculation.total_tokens: {options.total_tokens} exceeds the context ({limits.capacity})")
    else:
        resolve_tree(options, facts.get("choices"))


def _offline_facts(path: str) -> dict:
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    return {"hidden_size": int(cfg["hidden_size"]), "choices": cfg.get("eagle_choices")}


register_method(MethodSpec(
    name="eagle",
    options=EagleOptions,
    build=_build,
    needs_features=True,
    drafts_trees=True,
    placement="target",
    checkpoint="eagle",
    recipe="specray.training.eagle",
    requirement="an EAGLE head (EngineConfig.checkpoints['eagle'] / --eagle DIR; `specray train eagle`)",
    load=lambda path, ctx: _load(path, ctx),
    facts=lambda head: {"hidden_size": head.config.hidden_size, "choices": head.choices},
    offline_facts=_offline_facts,
    check=_check,
    inspect=_inspect,
))
