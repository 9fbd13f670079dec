"""ReDrafter (Apple's Recurrent Drafter; Cheng et al. 2024): a small recurrent drafter on
the target's last hidden state, beam search, and the beams packed into one prefix-shared
token tree per row.

The drafter (``apple/ml-recurrent-drafter``, ``modeling_drafter.py``): the context
``c = f_t`` is the target's final-norm hidden state at the last accepted position (the one
whose output is the row's root ``g_0``), fixed for the whole step. An RNN state runs over
the drafted tokens, read through the target's own embedding table ``E``::

    s_0 = 0,  s_k = SiLU(W E(g_{k-1}) + U s_{k-1})        (rnn; without it s_k = E(g_{k-1}) + s_{k-1})
    logits_k = lm_head([c ; s_k])                          (optional input_proj 2H -> exit_dim,
                                                            num_draft_layers ResBlocks x + SiLU(Ax + b),
                                                            a vocabulary projection exit_dim -> V)

Beam search (``num_beams`` M x ``draft_len_per_beam`` L): every beam starts at the root; the
first level takes the M best tokens of ``log p_1``, each later level keeps the M best of the
M x V extensions scored by the sum of the drafter's log-probabilities. M distinct beams of L
tokens come out. (Apple's drafter also renormalises each level over its 50 best tokens; for
M <= 50 that admits the same candidates and only shifts each beam's score by its level's
normaliser. specray scores with the drafter's own log-probabilities, which spares a top-50
per beam and level — the largest cost of drafting on CPU. Either way the beams are
deterministic proposals, and acceptance is exact.)

Dynamic tree attention: beams sharing a prefix are de-duplicated into one token tree below
the root (beams in score order; each beam adds only the nodes its prefix does not already
have), so a shared prefix is verified once. Every row of a batch carries its own tree
(``TokenTree.from_parents``); the target verifies it under the tree mask, and only the
accepted path's KV is kept (the runner's compaction). Near the end of the context or of
``max_tokens`` the tree is cut to the step's room: the first ``row.num_tokens`` nodes in
that order, so the best beams stay whole and every kept node's parent is kept.

Acceptance is the tree rule (``kernels/tree_acceptance.py``), lossless for any sampling:

* greedy: the longest beam prefix whose tokens all equal the target's argmax, plus the
  target's next token (ReDrafter's own rule; siblings are distinct, so the walk is unique);
* sampling: the beams are a deterministic function of the committed prefix (beam search,
  not sampled beams), so every node is a deterministic proposal (one-hot q) and recursive
  rejection over siblings keeps the target's distribution exactly. (ReDrafter's own
  sampled acceptance compares each beam with the drafter's q along it; its README says it
  "might not give the exact distribution match". TensorRT-LLM's non-greedy beam search,
  ``redrafter_greedy_search=False``, is not offered: beams picked by sampled scores would
  need the q of the selection, not of each token.)

Checkpoints use Apple's public layout (read by TensorRT-LLM's ``convert_checkpoint.py``):
``config.json`` with ``model_type: "recurrent_drafting_drafter"``, ``vocab_size``,
``hidden_size``, ``exit_dim``, ``num_draft_layers``, ``rnn``; weights in
``model.safetensors`` (or ``model.pt`` / ``pytorch_model.bin``) named ``input_proj.{weight,
bias}`` (only when ``exit_dim != 2 * hidden_size``), ``lm_head.{i}.linear.{weight,bias}``,
``lm_head.{num_draft_layers}.weight``, ``rnn_u.{weight,bias}``, ``rnn_w.weight`` (the other
spellings TensorRT-LLM accepts, ``lm_heads.*``/``input_projs.*``/``0.*``, load too).
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal, Sequence

import torch
from pydantic import Field
from torch import nn

from specray.kernels.tree import TokenTree
from specray.policies.checkpoint_files import building, load_weights, read_json_config, read_tensors
from specray.policies.base import (
    CommitRow, DeviceDraft, DeviceTrees, Draft, DraftRow, PrefillRow, ProposalRow, placeholder_tree,
)
from specray.policies.compiled import at_least_two, compile_fn
from specray.policies.medusa import ResBlock
from specray.policies.registry import Limits, MethodSpec, TreeAcceptanceOptions, register_method

MODEL_TYPE = "recurrent_drafting_drafter"
WEIGHT_FILES = ("model.safetensors", "model.pt", "pytorch_model.bin")
MAX_BEAMS, MAX_DRAFT_LEN = 50, 16
# Other spellings of the same tensors that TensorRT-LLM's converter accepts.
_ALIASES = (("lm_heads.", "lm_head."), ("input_projs.", "input_proj."), ("0.", "lm_head."))


class ReDrafterOptions(TreeAcceptanceOptions):
    """Beam search of ``num_beams`` x ``draft_len_per_beam`` tokens, packed into a tree."""

    method: Literal["redrafter"] = "redrafter"
    num_beams: int = Field(4, ge=1, le=MAX_BEAMS, description="Beams kept by the drafter's beam search "
                           "(TensorRT-LLM's redrafter_num_beams).")
    draft_len_per_beam: int = Field(4, ge=1, le=MAX_DRAFT_LEN, description="Tokens drafted per beam "
                                    "(redrafter_draft_len_per_beam; at most the length the drafter was trained for "
                                    "is advised).")


# -- the drafter ---------------------------------------------------------------------------
class Drafter(nn.Module):
    """Apple's recurrent drafter (module names = the public checkpoint's tensor names)."""

    def __init__(self, hidden_size: int, vocab_size: int, exit_dim: int | None = None, num_draft_layers: int = 2,
                 rnn: bool = True):
        super().__init__()
        exit_dim = exit_dim or 2 * hidden_size
        if min(hidden_size, vocab_size, exit_dim) < 1 or num_draft_layers < 0:
            raise ValueError(f"need positive hidden_size/vocab_size/exit_dim and num_draft_layers >= 0, got "
                             f"{hidden_size}, {vocab_size}, {exit_dim}, {num_draft_layers}")
        self.hidden_size, self.vocab_size, self.exit_dim = hidden_size, vocab_size, exit_dim
        self.num_draft_layers, self.rnn = num_draft_layers, rnn
        if exit_dim != 2 * hidden_size:
            self.input_proj = nn.Linear(2 * hidden_size, exit_dim)
        self.lm_head = nn.Sequential(*[ResBlock(exit_dim) for _ in range(num_draft_layers)],
                                     nn.Linear(exit_dim, vocab_size, bias=False))
        if rnn:
            self.rnn_u = nn.Linear(hidden_size, hidden_size)
            self.rnn_w = nn.Linear(hidden_size, hidden_size, bias=False)

    def next_state(self, emb: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """s_k from E(g_{k-1}) and s_{k-1} (None = s_0 = 0): [..., H]."""
        if not self.rnn:
            return emb if state is None else emb + state
        pre = self.rnn_w(emb) + (self.rnn_u.bias if state is None else self.rnn_u(state))  # U 0 + b = b
        return nn.functional.silu(pre)

    def logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[..., H] context and state -> [..., V] drafter logits."""
        x = torch.cat([context, state], dim=-1)
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        return self.lm_head(x)

    def log_probs(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[..., V] the drafter's log-probabilities (beam-search scores)."""
        return self.logits(context, state).float().log_softmax(dim=-1)

    def forward_sequence(self, context: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Training / teacher forcing: context [N, H], embeddings of g_0 .. g_{L-1} [N, L, H]
        -> logits [N, L, V], level k predicting g_{k+1}."""
        state, states = None, []
        for k in range(embeds.shape[1]):
            state = self.next_state(embeds[:, k], state)
            states.append(state)
        states = torch.stack(states, dim=1)
        return self.logits(context[:, None].expand_as(states), states)

    def beam_level(self, context: torch.Tensor, states: torch.Tensor, last: torch.Tensor, scores: torch.Tensor,
                   embed: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One level of the beam search for every row (tensor ops only; what ``propose_on_device``
        runs, compiled under ``step=compile``). context, states [B, M, H] (s_{k-1}; zeros at the
        first level: U 0 + b = b), last [B, M] the beams' last tokens, scores [B, M] (the first
        level: 0 for beam 0, -inf for the others, so the M best tokens of one beam are taken).
        Returns the new scores [B, M], each new beam's parent beam [B, M], its token [B, M]
        and its state [B, M, H]."""
        dtype = context.dtype
        states = self.next_state(embed(last).to(dtype), states)  # [B, M, H]
        logp = self.log_probs(context, states)  # [B, M, V]
        b, m, vocab = logp.shape
        scores, idx = (scores[..., None] + logp).view(b, m * vocab).topk(m, dim=-1)  # [B, M]
        parent = idx // vocab
        return scores, parent, idx % vocab, states.gather(1, parent[..., None].expand(-1, -1, states.shape[-1]))

    @torch.inference_mode()
    def beam_search(self, context: torch.Tensor, roots: torch.Tensor, embed: nn.Module, num_beams: int,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """context [B, H], roots [B] int64 -> beams [B, M, L] int64 (best first), scores [B, M]
        (sum of the drafter's log-probs along each beam). Beams are distinct."""
        dtype = next(self.parameters()).dtype
        context = context.to(dtype)
        b, m = context.shape[0], num_beams
        state = self.next_state(embed(roots).to(dtype), None)  # [B, H]: the same for every beam
        scores, tokens = self.log_probs(context, state).topk(m, dim=-1)  # [B, M]
        beams = tokens[..., None]  # [B, M, 1]
        states = state[:, None].expand(b, m, -1)  # [B, M, H]
        context = context[:, None].expand(b, m, -1)
        for _ in range(length - 1):
            states = self.next_state(embed(beams[..., -1]).to(dtype), states)
            logp = self.log_probs(context, states)  # [B, M, V]
            vocab = logp.shape[-1]
            scores, idx = (scores[..., None] + logp).view(b, m * vocab).topk(m, dim=-1)  # [B, M]
            parent, tok = idx // vocab, idx % vocab
            beams = torch.cat([beams.gather(1, parent[..., None].expand(-1, -1, beams.shape[-1])), tok[..., None]], -1)
            states = states.gather(1, parent[..., None].expand(-1, -1, states.shape[-1]))
        return beams, scores

    # -- Apple's public checkpoint layout ----------------------------------------------------
    def config_dict(self) -> dict:
        return {"model_type": MODEL_TYPE, "architectures": ["Drafter"], "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "exit_dim": self.exit_dim,
                "num_draft_layers": self.num_draft_layers, "num_lookback_tokens": -1, "rnn": self.rnn}

    def save(self, directory: str | pathlib.Path, base_model: str | None = None, **extra) -> None:
        """config.json + model.safetensors; ``extra`` config fields are kept (e.g. training facts)."""
        from safetensors.torch import save_file

        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = {**self.config_dict(), "base_model_name_or_path": base_model, **extra}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(out / WEIGHT_FILES[0]))

    @classmethod
    def load(cls, directory: str | pathlib.Path, hidden_size: int | None = None,
             vocab_size: int | None = None, described: bool = False) -> "Drafter":
        """A drafter from Apple's layout; ``hidden_size``/``vocab_size``: the target's, checked
        (``described``: only checked, see checkpoint_files)."""
        path = pathlib.Path(directory)
        cfg = read_config(path)
        if hidden_size is not None and cfg["hidden_size"] != hidden_size:
            raise ValueError(f"the drafter expects hidden size {cfg['hidden_size']}, the target has {hidden_size}")
        if vocab_size is not None and cfg["vocab_size"] != vocab_size:
            raise ValueError(f"the drafter has vocab size {cfg['vocab_size']}, the target {vocab_size}")
        state, weights = read_tensors(path, WEIGHT_FILES, described)
        with building(described):
            drafter = cls(cfg["hidden_size"], cfg["vocab_size"], cfg["exit_dim"], cfg["num_draft_layers"], cfg["rnn"])
        load_weights(drafter, _canonical(state), described,
                     f"{weights} does not match the drafter of {path / 'config.json'}")
        return drafter.eval()


def _canonical(state: dict) -> dict:
    """Tensor names as Apple's Drafter module spells them (``drafter.`` prefix and
    TensorRT-LLM's alternative spellings accepted)."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("drafter.")
        for old, new in _ALIASES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def read_config(path: pathlib.Path) -> dict:
    """The drafter's config.json, checked: the fields the module needs, with their types."""
    raw, cfg_file = read_json_config(path, "a ReDrafter drafter")
    if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"{cfg_file}: model_type {raw['model_type']!r} is not {MODEL_TYPE!r}")
    missing = [k for k in ("vocab_size", "hidden_size", "num_draft_layers") if k not in raw]
    if missing:
        raise ValueError(f"{cfg_file} lacks {missing}: not a ReDrafter config")
    cfg = {k: raw[k] for k in ("vocab_size", "hidden_size", "num_draft_layers")}
    cfg["rnn"] = raw.get("rnn", False)
    cfg["exit_dim"] = raw.get("exit_dim", -1)
    for key in ("vocab_size", "hidden_size", "num_draft_layers", "exit_dim"):
        value = cfg[key]
        ok = isinstance(value, int) and not isinstance(value, bool) and (
            value >= 0 if key == "num_draft_layers" else value >= 1 or (key == "exit_dim" and value == -1))
        if not ok:
            raise ValueError(f"{cfg_file}: {key} must be a {'non-negative' if key == 'num_draft_layers' else 'positive'} "
                             f"integer, got {cfg[key]!r}")
    if cfg["exit_dim"] == -1:  # Apple's config default: no input projection
        cfg["exit_dim"] = 2 * cfg["hidden_size"]
    if not isinstance(cfg["rnn"], bool):
        raise ValueError(f"{cfg_file}: rnn must be true or false, got {cfg['rnn']!r}")
    return cfg


# -- packing beams into a tree -------------------------------------------------------------
def pack_beams(beams: Sequence[Sequence[int]], budget: int) -> tuple[list[int], list[int], list[int]]:
    """Beams (best first) as one prefix-shared tree below the root, at most ``budget`` nodes:
    (node tokens, parents, each beam's kept length). Node i + 1 hangs under ``parents[i]``
    (0 = the root); a beam's nodes come after the nodes of the beams before it, so cutting
    the node list keeps whole beams first and every node's parent. A beam's kept length is
    how deep the tree holds it, 0 when the cut left none of its own nodes.

    >>> pack_beams([[5, 6, 7], [5, 6, 8], [4, 6, 7]], budget=8)
    ([5, 6, 7, 8, 4, 6, 7], [0, 1, 2, 2, 0, 5, 6], [3, 3, 3])
    """
    tokens: list[int] = []
    parents: list[int] = []
    children: list[dict[int, int]] = [{}]
    kept = []
    for beam in beams:
        node, depth, own = 0, 0, False
        for tok in beam:
            nxt = children[node].get(tok)
            if nxt is None:
                if len(tokens) >= budget:
                    break
                tokens.append(tok)
                parents.append(node)
                children.append({})
                nxt = children[node][tok] = len(tokens)
                own = True
            node, depth = nxt, depth + 1
        kept.append(depth if own else 0)
    return tokens, parents, kept


def pack_on_device(beams: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_beams`` for a batch on the device: beams [B, M, L] (best first, distinct) ->
    node tokens [B, size], parents [B, size] (node i + 1 under node parents[:, i], 0 = root)
    and [3] (rows, packed tokens, unpacked tokens) summed over the batch. Node (m, d) — beam
    m's token at depth d — is new unless an earlier beam has the same tokens up to d; new
    nodes are numbered beam by beam, depth by depth, the first ``size`` kept. Nodes past the
    merged count are copies of node 1 (a root child with the same token)."""
    b, m, length = beams.shape
    device = beams.device
    same = (beams[:, :, None, :] == beams[:, None, :, :]).long().cumprod(dim=-1)  # [B, M, M', L] equal up to d
    owner = same.argmax(dim=2)  # [B, M, L]: the first beam with that prefix (m itself at the latest)
    new = owner == torch.arange(m, device=device)[None, :, None]
    flat = new.reshape(b, m * length).long()
    number = (flat.cumsum(dim=1) * flat).view(b, m, length)  # 1-based node numbers of new nodes, 0 else
    node = number.gather(1, owner)  # [B, M, L] every (m, d)'s node, new or shared
    parent = torch.cat([node.new_zeros(b, m, 1), node[..., :-1]], dim=-1)
    kept = new & (number <= size)
    at = torch.where(kept, number - 1, size).view(b, -1)  # dropped nodes go to a dump column
    tokens = beams[:, :1, 0].expand(-1, size + 1).contiguous()  # pads: node 1's token under the root
    tokens.scatter_(1, at, beams.reshape(b, -1))
    parents = torch.zeros(b, size + 1, dtype=torch.long, device=device).scatter_(1, at, parent.reshape(b, -1))
    own = kept.any(dim=-1)  # [B, M] beams with a node of their own in the tree
    depth = (node <= size).sum(dim=-1)  # how deep the tree holds each beam
    packed = 1 + torch.minimum(flat.sum(dim=1), torch.tensor(size, device=device))
    unpacked = torch.where(own, 1 + depth, 0).sum(dim=1)
    counts = torch.stack([torch.tensor(b, device=device), packed.sum(), unpacked.sum()])
    return tokens[:, :size], parents[:, :size], counts


# -- the proposer --------------------------------------------------------------------------
class ReDrafterProposer:
    """Beam search from the target's hidden state at each row's last emitted position (handed
    over by prefill and every commit), packed into a tree per row.

    ``counts``: rows drafted, and the tokens their verification costs with the packing
    (root + tree nodes) and without it (each kept beam as its own sequence, root included,
    as ReDrafter verifies without tree attention) — the packing's saving, for benchmarks.
    """

    def __init__(self, drafter: Drafter, embed: nn.Module, step: str = "eager"):
        self.drafter, self.embed = drafter, embed
        self._last: dict[int, torch.Tensor] = {}  # slot -> [H]
        self._counts = {"rows": 0, "packed": 0, "unpacked": 0}
        self._device_counts: torch.Tensor | None = None  # [3] the same, summed on the device
        # one level of the beam search, compiled under step=compile (``policies/compiled.py``)
        self._level = compile_fn(drafter.beam_level, embed.weight.device) if step == "compile" else None

    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        for row in rows:
            self._last[row.slot] = row.features[-1]

    def commit(self, rows: Sequence[CommitRow]) -> None:
        for row in rows:
            self._last[row.slot] = row.features[-1]

    def release(self, slot: int) -> None:
        self._last.pop(slot, None)

    @torch.inference_mode()
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if any(r.slot not in self._last for r in rows):
            raise ValueError("redrafter needs the target's hidden state for every row (prefill/commit features)")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(rows):  # one batched beam search per beam shape
            shape = (r.options.num_beams, min(r.options.draft_len_per_beam, r.num_tokens))
            groups.setdefault(shape, []).append(i)
        out: list[DraftRow | None] = [None] * len(rows)
        device = self.embed.weight.device
        for (m, length), idx in groups.items():
            context = torch.stack([self._last[rows[i].slot] for i in idx])  # [b, H]
            roots = torch.tensor([rows[i].token_ids[-1] for i in idx], device=device)
            beams, _ = self.drafter.beam_search(context, roots, self.embed, m, length)
            for i, row_beams in zip(idx, beams.tolist()):
                out[i] = self._pack(row_beams, rows[i].num_tokens)
        return Draft(out)

    @torch.inference_mode()
    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft:
        """The same beams, searched and packed on the device (``pack_on_device``): tokens and
        tree structure never leave it. A row's tree has min(room, M x L) nodes whatever its
        beams share (the host must know the size): shared prefixes are merged as ``pack_beams``
        does, and the nodes they free are padded with copies of node 1 (a sibling with the
        same token: never accepted in its stead, so the draft stays exact)."""
        if any(r.slot not in self._last for r in rows):
            raise ValueError("redrafter needs the target's hidden state for every row (prefill/commit features)")
        device = self.embed.weight.device
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, r in enumerate(rows):
            m, length = r.options.num_beams, min(r.options.draft_len_per_beam, r.num_tokens)
            groups.setdefault((m, length, min(r.num_tokens, m * length)), []).append(i)
        sizes = [0] * len(rows)
        for (m, length, size), idx in groups.items():
            for i in idx:
                sizes[i] = size
        tokens = torch.zeros(len(rows), max(sizes), dtype=torch.long, device=device)
        trees = []
        for (m, length, size), idx in groups.items():
            context = torch.stack([self._last[rows[i].slot] for i in idx])  # [b, H]
            roots = torch.tensor([rows[i].token_ids[-1] for i in idx]).to(device, non_blocking=True)
            beams = self._search(context, roots, m, length)  # [b, M, L]
            toks, parents, counts = pack_on_device(beams, size)
            sel = torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)
            tokens[sel, :size] = toks
            # the root may hold every beam's first token and every pad
            trees.append(DeviceTrees(idx, parents, length, m + size - min(size, length + m - 1)))
            self._device_counts = counts if self._device_counts is None else self._device_counts + counts
        return DeviceDraft([DraftRow([0] * s, placeholder_tree(s)) for s in sizes], tokens, None, trees=trees)

    def _search(self, context: torch.Tensor, roots: torch.Tensor, m: int, length: int) -> torch.Tensor:
        """Beam search on the device, a level at a time: beams [b, M, L] (best first)."""
        dtype = next(self.drafter.parameters()).dtype
        b, device = context.shape[0], context.device
        level = self._level if self._level is not None and m >= 2 else self.drafter.beam_level
        n = max(b, 2) if level is self._level else b  # a compiled graph never sees a batch of 1
        context = at_least_two(context.to(dtype))[:n, None].expand(-1, m, -1)  # [n, M, H]
        states = context.new_zeros(context.shape)
        last = at_least_two(roots)[:n, None].expand(-1, m).contiguous()
        scores = torch.full((n, m), float("-inf"), device=device)
        scores[:, 0] = 0.0
        beams = torch.zeros(n, m, 0, dtype=torch.long, device=device)
        for _ in range(length):
            scores, parent, last, states = level(context, states, last, scores, self.embed)
            beams = torch.cat([beams.gather(1, parent[..., None].expand(-1, -1, beams.shape[-1])), last[..., None]], -1)
        return beams[:b]

    @property
    def counts(self) -> dict[str, int]:
        """Rows drafted and verification tokens with and without the packing (host and device drafts)."""
        out = dict(self._counts)
        if self._device_counts is not None:
            for key, v in zip(("rows", "packed", "unpacked"), self._device_counts.tolist()):
                out[key] += v
        return out

    def _pack(self, beams: list[list[int]], room: int) -> DraftRow:
        tokens, parents, kept = pack_beams(beams, room)
        self._counts["rows"] += 1
        self._counts["packed"] += 1 + len(tokens)
        self._counts["unpacked"] += sum(1 + k for k in kept if k)
        return DraftRow(tokens, TokenTree.from_parents(parents))


# -- the spec ------------------------------------------------------------------------------
def _load(path: str, ctx) -> Drafter:
    drafter = Drafter.load(path, hidden_size=ctx.target.hidden_size, vocab_size=ctx.vocab_size)
    return ctx.place(drafter)


def _build(ctx) -> ReDrafterProposer:
    embed = ctx.target.decoder.get_input_embeddings()  # the target's own table
    drafter = ctx.place(ctx.resource)
    return ReDrafterProposer(drafter, embed, ctx.step)


def _check(options: ReDrafterOptions, facts: dict, limits: Limits) -> None:
    if options.num_beams > limits.vocab_size:
        raise ValueError(f"speculation.num_beams: {options.num_beams} exceeds the vocabulary ({limits.vocab_size})")


def _offline_facts(path: str) -> dict:
    cfg = read_config(pathlib.Path(path))
    return {"hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"]}


register_method(MethodSpec(
    name="redrafter",
    options=ReDrafterOptions,
    build=_build,
    needs_features=True,
    drafts_trees=True,
    placement="target",
    checkpoint="redrafter",
    recipe="specray.training.redrafter",
    requirement="a ReDrafter drafter (EngineConfig.checkpoints['redrafter'] / --redrafter DIR; "
                "`specray train redrafter`)",
    load=_load,
    facts=lambda drafter: {"hidden_size": drafter.hidden_size, "vocab_size": drafter.vocab_size},
    offline_facts=_offline_facts,
    check=_check,
    inspect=lambda path, t: {"vocab_size": Drafter.load(path, t.hidden_size, t.vocab_size, described=True).vocab_size},
))
