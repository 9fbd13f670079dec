"""Medusa: K extra heads on the target's last hidden state guess tokens t+2 .. t+K+1.

Heads use the public Medusa checkpoint layout (FasterDecoding/Medusa), so existing heads
load: ``config.json`` with ``medusa_num_heads`` and ``medusa_num_layers`` (and
``hidden_size``/``vocab_size`` if present), weights in ``medusa_lm_head.safetensors`` or
``medusa_lm_head.pt`` with keys ``{head}.{layer}.linear.weight|bias`` for the residual
blocks and ``{head}.{num_layers}.weight`` for each head's vocabulary projection.

The proposer places each head's top-k on a ``medusa_choices`` tree; the target verifies
the whole tree in one forward, and its hidden state at the last accepted node feeds the
next round's heads.
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal, Sequence

import torch
from pydantic import Field, field_validator
from torch import nn

from specray.kernels.tree import NAMED_TREES, TokenTree, TreeError, build_tree, normalize_choices
from specray.policies.base import CommitRow, DeviceDraft, Draft, DraftRow, PrefillRow, ProposalRow
from specray.policies.checkpoint_files import building, load_weights, read_json_config, read_tensors
from specray.policies.compiled import at_least_two, compile_fn
from specray.policies.registry import MethodSpec, TreeAcceptanceOptions, register_method

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
DEFAULT_TREE = "trtllm_example"


class MedusaOptions(TreeAcceptanceOptions):
    """Medusa heads' top-k placed on a tree (``medusa_choices``, or a named ``tree``)."""

    method: Literal["medusa"] = "medusa"
    medusa_choices: list[list[int]] | None = Field(
        None, description="The tree: every candidate, or only the unique paths (TensorRT-LLM's two forms)."
    )
    tree: str | None = Field(None, description="A named tree (chain, trtllm_example, wide).")

    @field_validator("medusa_choices")
    @classmethod
    def _valid_tree(cls, v):
        if v is not None:
            normalize_choices(v)  # TreeError (a ValueError) names what is wrong
        return v

    @field_validator("tree")
    @classmethod
    def _known_tree(cls, v):
        if v is not None and v not in NAMED_TREES:
            raise ValueError(f"unknown tree {v!r}; named trees: {sorted(NAMED_TREES)}")
        return v


class ResBlock(nn.Module):
    """x + SiLU(W x + b), initialized as the identity (W = 0)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads, each ``num_layers`` ResBlocks and a vocabulary projection."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need medusa_num_heads >= 1 and medusa_num_layers >= 0, got {num_heads}, {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        # The heads' own default tree (``medusa_choices`` in config.json, e.g. fitted by
        # ``specray train medusa``); None means the global default.
        self.choices: list[list[int]] | None = None
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, K, V]
        return torch.stack([head(hidden) for head in self.heads], dim=1)

    # -- the public checkpoint layout --------------------------------------------------------
    def save(self, directory: str | pathlib.Path, base_model: str | None = None) -> None:
        from safetensors.torch import save_file

        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "base_model_name_or_path": base_model,
        }
        if self.choices is not None:
            config["medusa_choices"] = self.choices
        (out / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.contiguous() for k, v in self.heads.state_dict().items()}
        save_file(state, str(out / WEIGHT_FILES[0]))

    @classmethod
    def load(cls, directory: str | pathlib.Path, hidden_size: int | None = None, vocab_size: int | None = None,
             described: bool = False):
        """Heads from a Medusa checkpoint dir; ``hidden_size``/``vocab_size`` default to the file's
        (``described``: only checked, see checkpoint_files)."""
        cfg, cfg_file = read_json_config(directory, "a Medusa heads")
        if "medusa_num_heads" not in cfg:
            raise ValueError(f"{cfg_file} has no medusa_num_heads")
        state, weights = read_tensors(directory, WEIGHT_FILES, described)
        state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
        num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
        proj = state.get(f"0.{num_layers}.weight")
        if proj is None:
            raise ValueError(f"{weights}: no key '0.{num_layers}.weight' (head 0's projection); keys: {sorted(state)[:6]}")
        vocab, hidden = proj.shape
        if hidden_size is not None and hidden != hidden_size:
            raise ValueError(f"Medusa heads expect hidden size {hidden}, the target has {hidden_size}")
        with building(described):
            heads = cls(hidden, vocab_size or vocab, num_heads, num_layers)
        load_weights(heads.heads, state, described, f"{weights} does not match {num_heads} heads x {num_layers} layers")
        if cfg.get("medusa_choices") is not None:
            try:
                build_tree(cfg["medusa_choices"], max_depth=num_heads)
            except (TreeError, TypeError, ValueError) as exc:
                raise ValueError(f"{cfg_file}: bad medusa_choices: {exc}") from None
            heads.choices = cfg["medusa_choices"]
        return heads.eval()


def resolve_tree(options: MedusaOptions, num_heads: int, heads_choices=None) -> TokenTree:
    """The row's tree: explicit ``medusa_choices``, a named tree, the heads' own tree, or the default."""
    choices = options.medusa_choices
    if choices is None and options.tree:
        choices = NAMED_TREES[options.tree]
    if choices is None and heads_choices is not None:
        choices = heads_choices
    if choices is None:  # the default tree, cut to the heads there are
        choices = list(dict.fromkeys(tuple(c[:num_heads]) for c in NAMED_TREES[DEFAULT_TREE]))
    return build_tree(choices, max_depth=num_heads)


def _fit(tree: TokenTree, room: int) -> TokenTree:
    """The tree cut to its first ``room`` candidates (near the context or max_tokens, or
    under a speculation-length cap). Candidates are ordered by depth, so every kept node's
    parent is kept too."""
    return tree.prefix(room)


class MedusaProposer:
    """Drafts from the target's final hidden state at the row's last emitted position,
    which each commit (and prefill) hands it as the last of the row's features."""

    def __init__(self, medusa_heads: MedusaHeads, step: str = "eager", **_ignored):
        self.heads = medusa_heads
        self._last: dict[int, torch.Tensor] = {}  # slot -> [H]
        # the heads' forward, compiled under step=compile (``policies/compiled.py``)
        self._forward = (compile_fn(medusa_heads.forward, next(medusa_heads.parameters()).device) if step == "compile"
                         else None)

    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        for row in rows:
            self._last[row.slot] = row.features[-1]

    @torch.inference_mode()
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        trees, topk = self._ranked(rows)
        topk = topk.cpu()  # [B, K, k]
        return Draft([
            DraftRow(t.candidate_tokens(topk[i : i + 1, : t.max_depth])[0].tolist(), t) for i, t in enumerate(trees)
        ])

    @torch.inference_mode()
    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft:
        """The same trees with their tokens left on the device (one gather per distinct tree)."""
        trees, topk = self._ranked(rows)  # topk: [B, K, k] device
        width = max(t.size - 1 for t in trees)
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=topk.device)
        groups: dict[int, tuple[TokenTree, list[int]]] = {}
        for i, t in enumerate(trees):
            groups.setdefault(id(t), (t, []))[1].append(i)
        for tree, idx in groups.values():
            sel = torch.tensor(idx, dtype=torch.long).to(topk.device, non_blocking=True)
            tokens[sel, : tree.size - 1] = tree.candidate_tokens(topk[sel, : tree.max_depth])
        return DeviceDraft([DraftRow([0] * (t.size - 1), t) for t in trees], tokens, None)

    def _ranked(self, rows: Sequence[ProposalRow]) -> tuple[list[TokenTree], torch.Tensor]:
        """Each row's tree and the heads' top-k tokens per head, [B, K, k] on the heads' device."""
        if any(r.slot not in self._last for r in rows):
            raise ValueError("medusa needs the target's hidden state for every row (prefill/commit features)")
        trees = [_fit(resolve_tree(r.options, self.heads.num_heads, self.heads.choices), r.num_tokens) for r in rows]
        hidden = torch.stack([self._last[r.slot] for r in rows]).to(next(self.heads.parameters()).dtype)
        if self._forward is not None:
            logits = self._forward(at_least_two(hidden))[: len(rows)]  # [B, K, V]
        else:
            logits = self.heads(hidden)  # [B, K, V]
        k = max(max(t.topk) for t in trees)
        return trees, logits.topk(k, dim=-1).indices

    def commit(self, rows: Sequence[CommitRow]) -> None:
        for row in rows:
            self._last[row.slot] = row.features[-1]

    def release(self, slot: int) -> None:
        self._last.pop(slot, None)


def _check(options: MedusaOptions, facts: dict, limits) -> None:
    resolve_tree(options, facts["num_heads"])  # the tree no deeper than the heads


def _offline_facts(path: str) -> dict:
    """Head count from the checkpoint's config.json (without loading weights)."""
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    return {"num_heads": int(cfg["medusa_num_heads"])}


register_method(MethodSpec(
    name="medusa",
    options=MedusaOptions,
    build=lambda ctx: MedusaProposer(ctx.place(ctx.resource), ctx.step),
    needs_features=True,
    drafts_trees=True,
    placement="target",
    checkpoint="medusa",
    recipe="specray.training.medusa",
    requirement="Medusa heads (EngineConfig.medusa; `specray train medusa`)",
    load=lambda path, ctx: ctx.place(MedusaHeads.load(path, hidden_size=ctx.target.hidden_size)),
    facts=lambda heads: {"num_heads": heads.num_heads},
    offline_facts=_offline_facts,
    check=_check,
    inspect=lambda path, t: {"vocab_size": MedusaHeads.load(path, hidden_size=t.hidden_size, described=True).vocab_size},
))
