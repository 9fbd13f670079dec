"""DSpark: DFlash's block drafter plus a low-rank Markov head and a confidence head.

The backbone is DFlash's (``policies/dflash.py``: the target's taps fused and read as keys and
values by a few non-causal layers over ``[root, mask, ...]``, one forward per block); two small
heads read its final-norm states ``h_j`` (arXiv 2607.05147; vLLM speculators' ``dspark``):

* **Markov head** (``markov_rank`` r > 0): the previous block token's embedding
  ``e_j = W1[x_{j-1}]`` (r dims, indexed by the target's vocabulary) projected to the draft
  vocabulary by ``W2`` and added to position j's logits. Variants (``markov_head_type``):
  ``vanilla`` ``W2 e_j``; ``gated`` ``W2 (sigmoid(G [h_j; e_j]) * e_j)``; ``rnn`` a GRU-like
  state over the block, ``W2 tanh(o_j)`` with ``[g; c; o] = J [s_{j-1}; e_j; h_j]``,
  ``s_j = g s_{j-1} + (1 - g) tanh(c)``. Position j depends on the token drafted at j - 1,
  which a pure block drafter cannot see; r = 0 is plain DFlash.
* **Confidence head** (``enable_confidence_head``): ``sigmoid(w . [h_j; e_j] + b)`` (``e_j``
  only with ``confidence_head_with_markov``), trained on 1 - TV(p_draft, p_target): the
  probability that position j's draft is accepted given that j - 1's was. It reads nothing of
  position j's own token, so it is known before that token is drawn.

Drafting runs the backbone once, then walks the block's positions in order: position j's
bias comes from the token drafted at j - 1 (the root for the first), its token is the argmax
(greedy rows) or a draw from the biased, processed distribution (sampled rows, their own
generator's uniforms in position order), and that biased distribution is the q rejection
sampling reads, so sampling stays exact. The walk is device tensor ops only (no host read):
drafts stay on the device in the fixed-shape step modes, as DFlash's do. Each draft row carries
the confidence head's estimates (``DraftRow.confidence``) for the verification budget.

With ``sample_from_anchor`` (the layout's default) block position 0, the root's, drafts the
next token too: a block of B drafts B tokens, where DFlash's drafts B - 1.

Checkpoints are vLLM speculators' layout: ``config.json`` with ``speculators_model_type:
"dspark"``, the layers' Qwen3 config under ``transformer_layer_config`` (or at the top level),
``aux_hidden_state_layer_ids`` (the target hidden states read, as HF's ``hidden_states[k]``:
the input of decoder layer k; z-lab's/TRT-LLM's ``target_layer_ids``, the *output* of layer k,
read too), ``mask_token_id``, ``block_size``, ``sample_from_anchor``, ``markov_rank``,
``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
``draft_vocab_size``; tensors as DFlash's plus ``markov_head.markov_w1.weight`` [V, r],
``markov_head.markov_w2.weight`` [V_draft, r], ``markov_head.gate_proj.*`` (gated),
``markov_head.joint_proj.*`` (rnn), ``confidence_head.proj.{weight,bias}``, and with a reduced
draft vocabulary ``lm_head.weight`` [V_draft, H] and ``d2t`` (draft token i is target token
i + d2t[i]; ``t2d`` marks them).
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal, Sequence

import torch
from torch import nn

from specray.kernels.sampling import probs_from_logits, sample_from_uniform, uniforms
from specray.policies.base import DeviceDraft, Draft, DraftRow, ProposalRow
from specray.policies.checkpoint_files import building, load_weights, read_json_config, read_tensors
from specray.policies.dflash import WEIGHT_FILES, DFlashDrafter, DFlashProposer, check_block_tokens, qwen3_config
from specray.policies.pard import draw_block
from specray.policies.registry import LinearOptions, MethodSpec, register_method

MARKOV_TYPES = ("vanilla", "gated", "rnn")
DEFAULT_BLOCK = 8  # speculators' default
LAYOUT_KEYS = ("speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids", "target_layer_ids",
               "mask_token_id", "block_size", "sample_from_anchor", "markov_rank", "markov_head_type",
               "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size", "speculators_config",
               "speculators_version", "target_hidden_size", "dflash_config", "specray_acceptance")


class DSparkOptions(LinearOptions):
    """DSpark drafts ``num_speculative_tokens`` tokens (at most its block's drafts) in one forward."""

    method: Literal["dspark"] = "dspark"


# -- the heads ------------------------------------------------------------------------------------------
class MarkovHead(nn.Module):
    """The low-rank bias ``W2 e`` from the previous token's embedding ``e = W1[x]`` (see the module doc)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in MARKOV_TYPES:
            raise ValueError(f"markov_head_type {kind!r}: one of {list(MARKOV_TYPES)}")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One position: emb [.., r] of the previous token, hidden [.., H] -> (bias [.., V_draft],
        the rnn state [.., r] or None)."""
        hidden = hidden.to(emb.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(emb), None
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], -1))) * emb), None
        state = torch.zeros_like(emb) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat([state, emb, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return self.markov_w2(torch.tanh(output)), gate * state + (1 - gate) * torch.tanh(candidate)

    def block(self, prev: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over a block: prev [.., B] previous tokens, hidden [.., B, H] ->
        (bias [.., B, V_draft], embeddings [.., B, r])."""
        emb = self.markov_w1(prev)
        if self.kind != "rnn":
            return self.step(emb, hidden, None)[0], emb
        state, out = None, []
        for j in range(prev.shape[-1]):
            bias, state = self.step(emb[..., j, :], hidden[..., j, :], state)
            out.append(bias)
        return torch.stack(out, dim=-2), emb


class ConfidenceHead(nn.Module):
    """A per-position acceptance logit: ``proj`` [.., H (+ r)] -> [..]."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


# -- the drafter -------------------------------------------------------------------------------------------
class DSparkDrafter(DFlashDrafter):
    """DFlash's backbone with the Markov and confidence heads. ``layer_ids``: the target hidden
    states read (the input of decoder layer k, speculators' ``aux_hidden_state_layer_ids``);
    ``draft_vocab_size`` below the target's vocabulary gives the drafter an LM head of its own
    (``lm_head``, ``d2t``)."""

    def __init__(self, config, layer_ids: Sequence[int], mask_token_id: int, block_size: int = DEFAULT_BLOCK,
                 markov_rank: int = 0, markov_head_type: str = "vanilla", confidence: bool = False,
                 confidence_with_markov: bool = False, sample_from_anchor: bool = True,
                 draft_vocab_size: int | None = None):
        super().__init__(config, [k - 1 for k in layer_ids], mask_token_id, block_size)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.first_draft = 0 if sample_from_anchor else 1
        self.draft_vocab_size = int(draft_vocab_size or vocab)
        self.markov_head = (MarkovHead(vocab, self.draft_vocab_size, markov_rank, hidden, markov_head_type)
                            if markov_rank > 0 else None)
        if confidence_with_markov and self.markov_head is None:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0")
        self.confidence_with_markov = bool(confidence and confidence_with_markov)
        self.confidence_head = (ConfidenceHead(hidden + (markov_rank if self.confidence_with_markov else 0))
                                if confidence else None)
        self.lm_head = None
        if self.draft_vocab_size != vocab:
            if self.draft_vocab_size > vocab:
                raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the vocabulary ({vocab})")
            self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
            self.set_vocab(torch.arange(self.draft_vocab_size))

    @property
    def markov_rank(self) -> int:
        return self.markov_head.rank if self.markov_head is not None else 0

    @property
    def max_drafts(self) -> int:
        return self.block_size - self.first_draft

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``target_ids`` [draft_vocab_size], distinct and increasing."""
        ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor | None:
        """[V_draft] the target token of each draft token (None: the vocabularies are one)."""
        if self.lm_head is None:
            return None
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module, num_layers: int) -> "DSparkDrafter":
        """The target's embedding; its LM head unless the drafter has one of its own."""
        if embed_tokens.weight.shape[0] != self.config.vocab_size:
            raise ValueError(f"the DSpark drafter's vocabulary is {self.config.vocab_size} tokens, the target's "
                             f"{embed_tokens.weight.shape[0]}")
        return super().bind(embed_tokens, self.lm_head if self.lm_head is not None else lm_head, num_layers)

    def check_taps(self, num_layers: int) -> None:
        if not all(1 <= k < num_layers for k in self.layer_ids):
            raise ValueError(f"DSpark reads the target hidden states entering layers {list(self.layer_ids)} "
                             f"(aux_hidden_state_layer_ids); a target of {num_layers} layers has 1..{num_layers - 1}")

    # -- the heads over a block ------------------------------------------------------------------------
    def confidence(self, hidden: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        """hidden [.., H], emb [.., r] -> acceptance logits [..]."""
        features = torch.cat([hidden, emb.to(hidden.dtype)], -1) if self.confidence_with_markov else hidden
        return self.confidence_head(features)

    def teacher_forced(self, hidden: torch.Tensor, prev: torch.Tensor):
        """Training: hidden [.., B, H] of the draft positions, prev [.., B] the true previous
        tokens -> (draft logits [.., B, V_draft], confidence logits [.., B] or None)."""
        logits = self.get_output_embeddings()(hidden).float()
        emb = None
        if self.markov_head is not None:
            bias, emb = self.markov_head.block(prev, hidden)
            logits = logits + bias.float()
        conf = self.confidence(hidden, emb) if self.confidence_head is not None else None
        return logits, conf

    # -- the published layout ------------------------------------------------------------------------------
    def layout(self, num_target_layers: int | None = None, verifier: str | None = None) -> dict:
        """config.json in speculators' layout."""
        layer = {k: v for k, v in self.config.to_dict().items() if k not in ("_attn_implementation", "dflash_config")}
        layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=len(self.layers))
        rope = layer.get("rope_parameters") or {}
        if "rope_theta" in rope:
            layer.setdefault("rope_theta", rope["rope_theta"])
        return {
            "speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "block_size": self.block_size, "target_hidden_size": self.config.hidden_size,
            "aux_hidden_state_layer_ids": list(self.layer_ids), "mask_token_id": self.mask_token_id,
            "sample_from_anchor": self.first_draft == 0, "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head.kind if self.markov_head is not None else "vanilla",
            "enable_confidence_head": self.confidence_head is not None,
            "confidence_head_with_markov": self.confidence_with_markov, "num_target_layers": num_target_layers,
            "speculators_config": {
                "algorithm": "dspark", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.max_drafts}],
                "verifier": {"name_or_path": verifier, "architectures": []}},
        }

    def save(self, directory: str | pathlib.Path, num_target_layers: int | None = None,
             verifier: str | None = None) -> None:
        from safetensors.torch import save_file

        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.layout(num_target_layers, verifier), indent=2, default=str))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(out / WEIGHT_FILES[0]))

    @classmethod
    def load(cls, directory: str | pathlib.Path, hidden_size: int | None = None, num_layers: int | None = None,
             described: bool = False) -> "DSparkDrafter":
        """A drafter from speculators' layout; ``hidden_size``/``num_layers``: the target's,
        checked (``described``: only checked, see checkpoint_files)."""
        raw, cfg_file = read_json_config(directory, "a DSpark drafter")
        layer, options = drafter_options(raw, cfg_file)
        if hidden_size is not None and layer["hidden_size"] != hidden_size:
            raise ValueError(f"the DSpark drafter has hidden size {layer['hidden_size']}, the target {hidden_size}")
        state, weights = read_tensors(directory, WEIGHT_FILES, described)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        for shipped in ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"):
            state.pop(shipped, None)  # the target's
        if options["draft_vocab_size"] == layer["vocab_size"]:
            for shared in ("lm_head.weight", "d2t", "t2d"):  # a full-vocabulary head is the target's
                state.pop(shared, None)
        elif "d2t" not in state:
            raise ValueError(f"{weights}: a draft vocabulary of {options['draft_vocab_size']} < "
                             f"{layer['vocab_size']} needs d2t")
        t2d = state.pop("t2d", None)
        with building(described):
            drafter = cls(qwen3_config(layer), **options)
        if "d2t" in state:
            state["t2d"] = drafter.t2d.clone() if t2d is None else t2d.bool()
        load_weights(drafter, state, described, f"{weights} does not match the DSpark drafter of {cfg_file}")
        if drafter.lm_head is not None and not described:
            ids = drafter.draft_ids()
            if ids.min() < 0 or ids.max() >= layer["vocab_size"] or (ids.diff() <= 0).any():
                raise ValueError(f"{weights}: d2t must map draft tokens to distinct, increasing target tokens")
        if num_layers is not None:
            drafter.check_taps(num_layers)
        return drafter.eval()


def drafter_options(raw: dict, cfg_file) -> tuple[dict, dict]:
    """(the layers' config, DSparkDrafter's options) from a speculators config.json, checked."""
    kind = raw.get("speculators_model_type")
    if kind != "dspark":
        what = "a DFlash drafter (no Markov or confidence head)" if (
            raw.get("dflash_config") or kind == "dflash") else f"speculators_model_type {kind!r}"
        raise ValueError(f"{cfg_file}: not a DSpark drafter (speculators_model_type 'dspark'): {what}")
    layer = dict(raw.get("transformer_layer_config") or {k: v for k, v in raw.items() if k not in LAYOUT_KEYS})
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
                           "vocab_size") if k not in layer]
    if missing:
        raise ValueError(f"{cfg_file}: its transformer_layer_config lacks {missing}")
    if "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        raise ValueError(f"{cfg_file}: a sliding-window DSpark drafter: specray serves full-attention ones")
    if raw.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise ValueError(f"{cfg_file}: target_hidden_size {raw['target_hidden_size']} differs from the drafter's "
                         f"{layer['hidden_size']}: specray serves drafters as wide as their target")
    if raw.get("projector_type", "dflash") != "dflash":
        raise ValueError(f"{cfg_file}: projector_type {raw['projector_type']!r}: specray serves 'dflash'")
    nested = raw.get("dflash_config") or {}
    aux, outputs = raw.get("aux_hidden_state_layer_ids"), nested.get("target_layer_ids", raw.get("target_layer_ids"))
    if aux is None and outputs is not None and isinstance(outputs, list):
        aux = [k + 1 if isinstance(k, int) else k for k in outputs]  # the output of layer k enters layer k + 1
    if not isinstance(aux, list) or not aux or not all(isinstance(k, int) and not isinstance(k, bool) for k in aux):
        raise ValueError(f"{cfg_file}: needs aux_hidden_state_layer_ids (or target_layer_ids): a list of layer ids")
    mask = raw.get("mask_token_id", nested.get("mask_token_id"))
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ValueError(f"{cfg_file}: needs mask_token_id")
    anchor = raw.get("sample_from_anchor", True)
    block = raw.get("block_size", DEFAULT_BLOCK)
    if not isinstance(block, int) or block < (1 if anchor else 2):
        raise ValueError(f"{cfg_file}: block_size must be an integer >= {1 if anchor else 2}, got {block!r}")
    rank = raw.get("markov_rank", 0)
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{cfg_file}: markov_rank must be an integer >= 0, got {rank!r}")
    kind = raw.get("markov_head_type", "vanilla")
    if kind not in MARKOV_TYPES:
        raise ValueError(f"{cfg_file}: markov_head_type {kind!r}: one of {list(MARKOV_TYPES)}")
    confidence, with_markov = bool(raw.get("enable_confidence_head", False)), bool(raw.get(
        "confidence_head_with_markov", False))
    if confidence and with_markov and rank == 0:
        raise ValueError(f"{cfg_file}: confidence_head_with_markov needs markov_rank > 0")
    vocab = raw.get("draft_vocab_size") or layer["vocab_size"]
    return layer, {"layer_ids": aux, "mask_token_id": mask, "block_size": block, "markov_rank": rank,
                   "markov_head_type": kind, "confidence": confidence, "confidence_with_markov": with_markov,
                   "sample_from_anchor": bool(anchor), "draft_vocab_size": vocab}


# -- drafting --------------------------------------------------------------------------------------------
class DSparkProposer(DFlashProposer):
    """DFlash's proposer with the block's positions drawn in order under the Markov bias."""

    drafter: DSparkDrafter

    @torch.inference_mode()
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if not rows:
            return Draft([])
        ks, tokens, probs, conf = self._draft(rows)
        drafted = tokens.tolist()
        return Draft([DraftRow(t[:k], None, probs[i, :k] if probs is not None and not r.sampling.greedy else None,
                               confidence=c[:k] if c is not None else None)
                      for i, (r, t, k, c) in enumerate(zip(rows, drafted, ks, _per_row(conf, len(rows))))])

    @torch.inference_mode()
    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft | None:
        """The same drafts, their tokens left on the device; the confidences (a few floats a
        row, which the budget reads before verification) come back to the host."""
        if not rows:
            return None
        ks, tokens, probs, conf = self._draft(rows)
        return DeviceDraft([DraftRow([0] * k, confidence=c[:k] if c is not None else None)
                            for k, c in zip(ks, _per_row(conf, len(rows)))], tokens, probs)

    def _draft(self, rows: Sequence[ProposalRow]):
        """(k per row, tokens [n, k_max] (target ids), q [n, k_max, V] of sampled rows or None,
        acceptance estimates [n, k_max] or None)."""
        ks, out = self._run_block(rows)
        k_max = max(ks)
        logits, hidden = out.logits[:, :k_max], out.hidden[:, :k_max]  # [n, k, V_draft], [n, k, H]
        roots = torch.tensor([r.token_ids[-1] for r in rows], device=logits.device)
        tokens, probs, conf = markov_block(self.drafter, rows, ks, logits, hidden, roots)
        ids = self.drafter.draft_ids()
        if ids is not None:  # draft tokens to the target's
            tokens = ids[tokens]
            if probs is not None:
                full = probs.new_zeros(*probs.shape[:2], self.drafter.config.vocab_size)
                probs = full.index_copy_(2, ids, probs)
        return ks, tokens, probs, conf


def markov_block(drafter: DSparkDrafter, rows: Sequence[ProposalRow], ks: Sequence[int], logits: torch.Tensor,
                 hidden: torch.Tensor, roots: torch.Tensor):
    """The block's drafts, position by position: logits [n, k, V_draft] and hidden [n, k, H] of
    the backbone, roots [n] (target ids) -> (tokens [n, k] draft ids, q [n, k, V_draft] of sampled
    rows or None, acceptance probabilities [n, k] or None). Position j's Markov bias and
    confidence read the token drawn at j - 1; without a Markov head the draws are DFlash's."""
    head, n, k = drafter.markov_head, *logits.shape[:2]
    with_conf = drafter.confidence_head is not None
    if head is None:
        tokens, probs = draw_block(rows, ks, logits)
        conf = torch.sigmoid(drafter.confidence(hidden, None)).float() if with_conf else None
        return tokens, probs, conf
    ids = drafter.draft_ids()
    sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
    device = logits.device
    if sampled:
        sub = [rows[i] for i in sampled]
        sel = torch.tensor(sampled, dtype=torch.long).to(device, non_blocking=True)
        params = [torch.tensor([getattr(r.sampling, name) for r in sub], dtype=dt).to(device, non_blocking=True)
                  for name, dt in (("temperature", torch.float32), ("top_k", torch.long), ("top_p", torch.float32))]
        u = uniforms([ks[i] for i in sampled], [r.generator for r in sub], device, width=k)  # [s, k]
        probs = torch.zeros(n, k, logits.shape[-1], device=device)
    tokens, confs = torch.zeros(n, k, dtype=torch.long, device=device), []
    prev, state = roots, None  # target ids
    for j in range(k):
        emb = head.markov_w1(prev)  # [n, r]
        bias, state = head.step(emb, hidden[:, j], state)
        step = logits[:, j] + bias.float()  # [n, V_draft]
        tokens[:, j] = step.argmax(-1)
        if sampled:
            q = probs_from_logits(step[sel], *params, check=False)  # [s, V_draft]
            tokens[sel, j] = sample_from_uniform(q, u[:, j])
            probs[sel, j] = q
        if with_conf:
            confs.append(torch.sigmoid(drafter.confidence(hidden[:, j], emb)).float())
        prev = tokens[:, j] if ids is None else ids[tokens[:, j]]
    return tokens, probs if sampled else None, torch.stack(confs, 1) if with_conf else None


def _per_row(conf: torch.Tensor | None, n: int) -> list:
    """[n, k] estimates -> per row a tuple of floats (None without a confidence head)."""
    if conf is None:
        return [None] * n
    return [tuple(row) for row in conf.tolist()]


# -- the spec -----------------------------------------------------------------------------------------------
def _bind(drafter: DSparkDrafter, ctx) -> DSparkDrafter:
    target = ctx.target
    return ctx.place(drafter.bind(target.decoder.embed_tokens, target.lm_head, target.num_layers))


def _build(ctx) -> DSparkProposer:
    drafter = _bind(ctx.resource, ctx)
    runner = ctx.runner_for(drafter, extra_capacity=drafter.block_size + 1)
    return DSparkProposer(drafter, runner, ctx.vocab_size)


def _load(path: str, ctx) -> DSparkDrafter:
    return _bind(DSparkDrafter.load(path, ctx.target.hidden_size, ctx.target.num_layers), ctx)


def _inspect(path: str, target) -> dict:
    """The drafter's layout against the target: widths, every tensor's shape, its taps, the mask
    token, its vocabulary (the Markov head's W1 is indexed by the target's token ids)."""
    drafter = DSparkDrafter.load(path, target.hidden_size, target.num_layers, described=True)
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ValueError(f"its mask token {drafter.mask_token_id} is outside the target's vocabulary ({target.vocab_size})")
    return {"vocab_size": drafter.config.vocab_size}


def _facts(drafter: DSparkDrafter) -> dict:
    return {"block_size": drafter.block_size, "max_tokens": drafter.max_drafts}


def _offline_facts(path: str) -> dict:
    raw = json.loads((pathlib.Path(path) / "config.json").read_text())
    block = int(raw.get("block_size", DEFAULT_BLOCK))
    return {"block_size": block, "max_tokens": block - (0 if raw.get("sample_from_anchor", True) else 1)}


def _check(options: DSparkOptions, facts: dict, limits) -> None:
    most = facts.get("max_tokens", DEFAULT_BLOCK)
    check_block_tokens(options, most, f"a DSpark block of {facts.get('block_size', most)}")


register_method(MethodSpec(
    name="dspark",
    options=DSparkOptions,
    build=_build,
    needs_features=True,
    placement="target",
    checkpoint="dspark",
    recipe="specray.training.dspark",
    requirement="a DSpark drafter (EngineConfig.checkpoints['dspark'] / --dspark DIR; `specray train dspark`)",
    load=_load,
    facts=_facts,
    offline_facts=_offline_facts,
    check=_check,
    feature_layers=lambda drafter: drafter.layer_ids,
    inspect=_inspect,
    block=True,
    confidence=True,
))
