"""DFlash: a block-diffusion drafter that drafts a whole block in one non-causal forward, with
the target's hidden states injected as keys and values into every layer.

The drafter (Chen et al. 2026, arXiv 2602.06036; z-lab's ``DFlashDraftModel``, as vLLM's
``qwen3_dflash`` and SGLang read it):

* the target's hidden states after several of its layers (``target_layer_ids``: spread between
  layer 1 and L - 3) at each committed position are concatenated and fused,
  ``ctx = hidden_norm(fc(taps))`` (n H -> H);
* each of its few Qwen3-style layers (q/k RMS norms per head) reads the *context* as keys and
  values — ``k_norm(k_proj(ctx))``, ``v_proj(ctx)``, the same ctx in every layer, no input norm
  — beside the block's own: the block is ``[root, mask, mask, ...]`` (``block_size`` positions
  after the last committed token, through the target's frozen embedding), its attention
  non-causal inside the block;
* block position j >= 1 predicts the token at its own position through the drafter's ``norm``
  and the target's frozen LM head: one forward drafts block_size - 1 tokens.

Here the drafter runs on a ``ModelRunner`` of its own (a slot-indexed KV cache per layer, like
EAGLE's head): one forward's new tokens are a row's uncached context positions followed by its
block. Context columns keep their fused feature through every layer (their keys and values are
what each layer writes to the cache, and they are kept); block columns attend to the cached
context, the new context and the whole block (a layout mask), and are discarded after (the
length is rolled back: an integer). The target's taps reach the proposer through the commit
contract as EAGLE-3's do (``MethodSpec.feature_layers``: the inputs of layers id + 1), so the
cache always holds the target's true states of every committed position but the root.

Every position's token is drawn independently given the context: greedy rows take each
position's argmax, sampled rows draw each from the drafter's processed distribution there and
carry it as q (``pard.draw_block``), which keeps rejection sampling exact.

Checkpoints are z-lab's layout: ``config.json`` of a Qwen3 model (``architectures:
["DFlashDraftModel"]``) with ``dflash_config: {target_layer_ids, mask_token_id, block_size}``
(also read at the top level), and ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
``layers.N.self_attn.{q,k,v,o}_proj.weight`` (+ biases with ``attention_bias``),
``layers.N.self_attn.{q,k}_norm.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.{input,post_attention}_layernorm.weight`` in ``model.safetensors`` or
``pytorch_model.bin``; an ``embed_tokens``/``lm_head`` shipped beside them is the target's and
is not read, and ``mask_embedding.pt`` (a trained mask embedding, as vLLM reads it) replaces the
mask token's embedding. Sliding-window and DFlash-2 drafters (convolutions, a candidate
selector) are refused by name.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Literal, Sequence

import torch
from torch import nn

from specray.policies.base import CommitRow, DeviceDraft, Draft, DraftRow, PrefillRow, ProposalRow
from specray.policies.checkpoint_files import building, load_weights, read_json_config, read_tensors
from specray.policies.pard import draw_block
from specray.policies.registry import LinearOptions, MethodSpec, register_method

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
DEFAULT_BLOCK = 16  # z-lab's published -b16 drafters
CATCH_UP_THRESHOLD = 16  # rows with a longer uncached context (a new prompt) feed it in a forward of their own
SPECRAY_KEYS = ("specray_acceptance",)


class DFlashOptions(LinearOptions):
    """DFlash drafts ``num_speculative_tokens`` tokens (at most its block size - 1) in one forward."""

    method: Literal["dflash"] = "dflash"


def default_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's taps: one per draft layer, evenly spread over target layers 1 .. L - 3 (the middle
    one for a one-layer drafter); ids of layers whose *outputs* are read."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


# -- the drafter ----------------------------------------------------------------------------------------
class _Columns:
    """Which new columns of the running forward are context (a plain holder shared by the layers:
    [B, q, 1] bool, or None = every column is a block position)."""

    context: torch.Tensor | None = None


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.layer_idx, self.head_dim = layer_idx, getattr(config, "head_dim", None) or hidden // heads
        self.num_key_value_groups, self.scaling = heads // kv, self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, q, H] -> q [B, heads, q, d], k and v [B, kv heads, q, d] (normed, rotated)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v


class DFlashLayer(nn.Module):
    def __init__(self, config, layer_idx: int, columns: _Columns):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.config, self.columns = config, columns
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def inputs(self, hidden: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        """What q/k/v project: the block's normed hidden state; the fused context as it is."""
        x = self.input_layernorm(hidden)
        return x if context is None else torch.where(context, hidden, x)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """attended [B, q, heads, d] -> the layer's output [B, q, H]."""
        h = hidden + self.self_attn.o_proj(attended.reshape(*hidden.shape[:-1], -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_ids=None, **kwargs):
        """The runner's layer call: the specray attention function over the slot cache."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        context = self.columns.context
        q, k, v = self.self_attn.qkv(self.inputs(hidden_states, context), *position_embeddings)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attended, _ = attend(self.self_attn, q, k, v, attention_mask, scaling=self.self_attn.scaling, **kwargs)
        out = self.finish(hidden_states, attended)
        return out if context is None else torch.where(context, hidden_states, out)


class DFlashDrafter(nn.Module):
    """fc + hidden_norm + layers + norm; the target's embedding and LM head are bound.

    ``target_layer_ids``: the target layers whose outputs it reads; ``layer_ids``: the same as
    inputs of layers id + 1 (what the commit contract hands over); ``mask_token_id``,
    ``block_size``, ``causal`` (a block attending causally, where a checkpoint says so)."""

    def __init__(self, config, target_layer_ids: Sequence[int], mask_token_id: int, block_size: int = DEFAULT_BLOCK,
                 causal: bool = False):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        self.config = config
        hidden = config.hidden_size
        self.columns = _Columns()
        self.layers = nn.ModuleList([DFlashLayer(config, i, self.columns) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.target_layer_ids = tuple(int(k) for k in target_layer_ids)
        self.mask_token_id, self.block_size, self.causal = int(mask_token_id), int(block_size), bool(causal)
        self.mask_embedding: torch.Tensor | None = None  # a trained override of the mask token's embedding
        # the block position of the first draft: 1 (position j >= 1 predicts its own token);
        # 0 where the root's position drafts the next token too (DSpark's sample_from_anchor)
        self.first_draft = 1
        self._target = ()  # (embed_tokens, lm_head) of the target: bound, not parameters

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The taps as the runner names them: the residual stream entering layer id + 1."""
        return tuple(k + 1 for k in self.target_layer_ids)

    # -- the decoder surface a ModelRunner reads ---------------------------------------------------
    @property
    def embed_tokens(self):
        return self._target[0]

    def get_decoder(self):
        return self

    def get_output_embeddings(self):
        return self._target[1]

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module, num_layers: int) -> "DFlashDrafter":
        """Use the target's (frozen) embedding and LM head; check the taps against its depth."""
        if embed_tokens.weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"the DFlash drafter has hidden size {self.config.hidden_size}, the target "
                             f"{embed_tokens.weight.shape[1]}")
        self.check_taps(num_layers)
        if not 0 <= self.mask_token_id < embed_tokens.weight.shape[0]:
            raise ValueError(f"the DFlash mask token {self.mask_token_id} is outside the target's vocabulary "
                             f"({embed_tokens.weight.shape[0]})")
        self._target = (embed_tokens, lm_head)
        return self

    def check_taps(self, num_layers: int) -> None:
        if not all(0 <= k < num_layers - 1 for k in self.target_layer_ids):
            raise ValueError(f"DFlash reads the outputs of target layers {list(self.target_layer_ids)}; a target of "
                             f"{num_layers} layers has 0..{num_layers - 2} (not its last: that is its final norm's input)")

    # -- inputs ------------------------------------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """[.., n H] the target's taps -> [.., H] the fused context every layer reads as keys/values."""
        return self.hidden_norm(self.fc(taps))

    def noise(self, tokens: torch.Tensor) -> torch.Tensor:
        """[..] block tokens (the root, then masks) -> [.., H] their embeddings."""
        emb = self.embed_tokens(tokens)
        if self.mask_embedding is not None:
            emb = torch.where((tokens == self.mask_token_id)[..., None], self.mask_embedding.to(emb.dtype), emb)
        return emb

    # -- training and tests: many blocks over one sequence at once ---------------------------------------
    def blocks(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Every anchor's block at once, as training sees them: taps [b, S, n H] of a sequence's
        positions, tokens [b, S], anchors [b, A] (a block starts at its anchor's token, the rest
        masks, at positions anchor .. anchor + block - 1, seeing the context before its anchor
        and its own block). Returns the normed hidden states [b, A, block, H] (logits: the
        target's LM head)."""
        b, length = tokens.shape
        size, num = self.block_size, anchors.shape[1]
        offsets = torch.arange(size, device=tokens.device)
        positions = anchors[..., None] + offsets  # [b, A, block]
        block_tokens = torch.full_like(positions, self.mask_token_id)
        block_tokens[..., 0] = tokens.gather(1, anchors.clamp(max=length - 1))
        hidden = self.noise(block_tokens).flatten(1, 2).to(taps.dtype)  # [b, A * block, H]
        ctx = self.context(taps)  # [b, S, H]
        key_pos = torch.cat([torch.arange(length, device=tokens.device)[None].expand(b, -1), positions.flatten(1)], 1)
        sees_ctx = key_pos[:, None, :length] < anchors.repeat_interleave(size, 1)[..., None]  # [b, AB, S]
        block_id = torch.arange(num, device=tokens.device).repeat_interleave(size)
        sees_block = block_id[:, None] == block_id[None, :]  # [AB, AB]
        if self.causal:
            sees_block = sees_block & (offsets.repeat(num)[None, :] <= offsets.repeat(num)[:, None])
        allowed = torch.cat([sees_ctx, sees_block[None].expand(b, -1, -1)], dim=-1)  # [b, AB, S + AB]
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=tokens.device)
        mask = mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min)[:, None]
        cos, sin = self.rotary_emb(hidden, position_ids=key_pos)
        for layer in self.layers:
            attn = layer.self_attn
            _, k_ctx, v_ctx = attn.qkv(ctx, cos[:, :length], sin[:, :length])
            q, k, v = attn.qkv(layer.input_layernorm(hidden), cos[:, length:], sin[:, length:])
            keys = torch.cat([k_ctx, k], dim=2).repeat_interleave(attn.num_key_value_groups, 1)
            values = torch.cat([v_ctx, v], dim=2).repeat_interleave(attn.num_key_value_groups, 1)
            out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            hidden = layer.finish(hidden, out.transpose(1, 2))
        return self.norm(hidden).view(b, num, size, -1)

    # -- the published layout ------------------------------------------------------------------------------
    def save(self, directory: str | pathlib.Path, num_target_layers: int | None = None) -> None:
        from safetensors.torch import save_file

        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in self.config.to_dict().items() if k not in ("_attn_implementation", "dflash_config")}
        cfg.update({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": self.block_size,
                    "num_target_layers": num_target_layers, "tie_word_embeddings": False,
                    "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                                      "block_size": self.block_size}})
        rope = cfg.get("rope_parameters") or {}
        if "rope_theta" in rope:  # readers older than transformers 5 look for rope_theta
            cfg.setdefault("rope_theta", rope["rope_theta"])
        if self.causal:
            cfg["dflash_config"]["causal"] = True
        (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(out / WEIGHT_FILES[0]))
        if self.mask_embedding is not None:
            torch.save(self.mask_embedding.detach().cpu(), out / "mask_embedding.pt")

    @classmethod
    def load(cls, directory: str | pathlib.Path, hidden_size: int | None = None, num_layers: int | None = None,
             described: bool = False) -> "DFlashDrafter":
        """A drafter from z-lab's layout; ``hidden_size``/``num_layers``: the target's, checked
        (``described``: only checked, see checkpoint_files)."""
        raw, cfg_file = read_json_config(directory, "a DFlash drafter")
        options = drafter_options(raw, cfg_file)
        if hidden_size is not None and raw["hidden_size"] != hidden_size:
            raise ValueError(f"the DFlash drafter has hidden size {raw['hidden_size']}, the target {hidden_size}")
        state, weights = read_tensors(directory, WEIGHT_FILES, described)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        for shipped in ("embed_tokens.weight", "lm_head.weight"):
            if state.pop(shipped, None) is not None:
                log.info("%s: %s is not read (the target's serves)", weights, shipped)
        with building(described):
            drafter = cls(qwen3_config(raw), **options)
        load_weights(drafter, state, described, f"{weights} does not match the DFlash drafter of {cfg_file}")
        if num_layers is not None:
            drafter.check_taps(num_layers)
        override = pathlib.Path(directory) / "mask_embedding.pt"
        if override.is_file() and not described:
            vector = torch.load(override, map_location="cpu", weights_only=True)
            if not isinstance(vector, torch.Tensor) or vector.shape != (raw["hidden_size"],):
                raise ValueError(f"{override} must hold one [{raw['hidden_size']}] tensor")
            drafter.mask_embedding = vector
        return drafter.eval()


def drafter_options(raw: dict, cfg_file) -> dict:
    """The DFlash keys of a config.json (``dflash_config`` first, then the top level), checked."""
    nested = raw.get("dflash_config") or {}
    get = lambda key, default=None: nested.get(key, raw.get(key, default))  # noqa: E731
    arch = " ".join(raw.get("architectures") or [])
    if "DFlash2" in arch or any(k in nested for k in ("conv_kernel_size", "selector_rank")):
        raise ValueError(f"{cfg_file}: a DFlash-2 drafter (convolutions, candidate selector): specray serves DFlash")
    types = raw.get("layer_types") or []
    if "sliding_attention" in types or nested.get("use_swa") or raw.get("use_sliding_window"):
        raise ValueError(f"{cfg_file}: a sliding-window DFlash drafter: specray serves full-attention ones")
    for key in ("input_embedding_scale", "output_multiplier"):
        if float(get(key, 1.0)) != 1.0:
            raise ValueError(f"{cfg_file}: {key} {get(key)}: specray serves DFlash drafters without it")
    layers, mask = get("target_layer_ids"), get("mask_token_id")
    if not isinstance(layers, list) or not layers or not all(isinstance(k, int) for k in layers):
        raise ValueError(f"{cfg_file}: needs dflash_config.target_layer_ids (a list of target layer ids)")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise ValueError(f"{cfg_file}: needs dflash_config.mask_token_id")
    block = get("block_size", DEFAULT_BLOCK)
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{cfg_file}: block_size must be an integer >= 2, got {block!r}")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers") if k not in raw]
    if missing:
        raise ValueError(f"{cfg_file} lacks {missing}: not a DFlash drafter config")
    return {"target_layer_ids": layers, "mask_token_id": mask, "block_size": block, "causal": bool(get("causal", False))}


def qwen3_config(raw: dict):
    """The drafter's layer config (a Qwen3Config) from its config.json."""
    from transformers import Qwen3Config

    keep = {k: v for k, v in raw.items() if k not in ("dflash_config", "architectures", "auto_map", *SPECRAY_KEYS)}
    keep.update(model_type="qwen3", use_sliding_window=False, layer_types=None)
    return Qwen3Config(**{k: v for k, v in keep.items() if k != "model_type"})


# -- drafting --------------------------------------------------------------------------------------------
class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, runner, vocab_size: int):
        self.drafter, self.runner, self.vocab_size = drafter, runner, vocab_size
        self._pending: dict[int, list[torch.Tensor]] = {}  # slot -> taps of committed positions not cached yet

    # -- what the target tells us ------------------------------------------------------------------------
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        for row in rows:
            # A row that starts from a cached prefix (``row.start`` > 0; paged KV, prefix caching)
            # was attached to the drafter's cached context of it by the engine, and its taps begin
            # there: resetting would leave the prefix's context out of every block's attention.
            if not row.start:
                self.runner.reset(row.slot)
            self._pending[row.slot] = [row.features]

    def commit(self, rows: Sequence[CommitRow]) -> None:
        for row in rows:
            self._pending.setdefault(row.slot, []).append(row.features)

    def release(self, slot: int) -> None:
        self.runner.reset(slot)
        self._pending.pop(slot, None)

    # -- drafting -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if not rows:
            return Draft([])
        ks, tokens, probs = self._draft(rows)
        drafted = tokens.tolist()
        return Draft([DraftRow(t[:k], None, probs[i, :k] if probs is not None and not r.sampling.greedy else None)
                      for i, (r, t, k) in enumerate(zip(rows, drafted, ks))])

    @torch.inference_mode()
    def propose_on_device(self, rows: Sequence[ProposalRow]) -> DeviceDraft | None:
        """The same drafts, their tokens left on the device (the step's one read-back brings them)."""
        if not rows:
            return None
        ks, tokens, probs = self._draft(rows)
        return DeviceDraft([DraftRow([0] * k) for k in ks], tokens, probs)

    def _draft(self, rows: Sequence[ProposalRow]):
        """(k per row, tokens [n, k_max], q [n, k_max, V] of sampled rows or None)."""
        ks, out = self._run_block(rows)
        tokens, probs = draw_block(rows, ks, out.logits[:, : max(ks)])
        return ks, tokens, probs

    def _run_block(self, rows: Sequence[ProposalRow]):
        """(k per row, the runner's output at the draft positions: logits [n, block - first, V],
        hidden [n, block - first, H]) for each row's pending context and block."""
        size, first = self.drafter.block_size, self.drafter.first_draft
        ks = [min(r.num_tokens, size - first) for r in rows]
        contexts = []
        for r in rows:
            taps = self._pending.pop(r.slot, None)
            if not taps:
                raise ValueError(f"dflash: no committed features for slot {r.slot} (missing prefill/commit)")
            # every committed position but the root is in the cache once these are
            if self.runner.lengths[r.slot] + sum(len(t) for t in taps) != len(r.token_ids) - 1:
                raise ValueError(f"dflash: slot {r.slot} holds {self.runner.lengths[r.slot]} positions and "
                                 f"{sum(len(t) for t in taps)} pending for {len(r.token_ids)} tokens")
            contexts.append(self.drafter.context(torch.cat(taps).to(self.runner.dtype)))  # [c, H]
        behind = [i for i, c in enumerate(contexts) if len(c) > CATCH_UP_THRESHOLD]
        if behind:  # a new prompt: its context alone first, so it does not pad every other row
            self._run([rows[i].slot for i in behind], [contexts[i][:-1] for i in behind], None)
            for i in behind:
                contexts[i] = contexts[i][-1:]
        roots = torch.tensor([r.token_ids[-1] for r in rows], device=self.runner.device)
        block = torch.full((len(rows), size), self.drafter.mask_token_id, device=self.runner.device)
        block[:, 0] = roots
        return ks, self._run([r.slot for r in rows], contexts, self.drafter.noise(block).to(self.runner.dtype))

    def _forward(self, slots: list[int], contexts: list[torch.Tensor], blocks: torch.Tensor | None):
        """The draft positions' logits [n, block - first, V] of ``_run`` (None without blocks)."""
        out = self._run(slots, contexts, blocks)
        return out.logits if out is not None else None

    def _run(self, slots: list[int], contexts: list[torch.Tensor], blocks: torch.Tensor | None):
        """One runner forward of each row's new context columns (kept) then its block (rolled
        back); returns the runner's output at the draft positions (block positions ``first_draft``
        .. block - 1), or None without blocks."""
        size = 0 if blocks is None else blocks.shape[1]
        lengths = [len(c) + size for c in contexts]
        q = max(lengths)
        device = self.runner.device
        # column j of row b: context (keeps its fused feature) for j < c_b, block after
        cols = torch.arange(q)
        is_ctx = cols[None, :] < torch.tensor([len(c) for c in contexts])[:, None]  # [B, q]
        in_row = cols[None, :] < torch.tensor(lengths)[:, None]
        block_q = ~is_ctx & in_row
        # block queries see every column of their row (or, causal, the context and the block up to them)
        mask = block_q[:, :, None] & in_row[:, None, :]
        if self.drafter.causal:
            mask &= cols[None, None, :] <= cols[None, :, None]
        mask |= torch.eye(q, dtype=torch.bool)[None]  # context (and padding) columns: themselves
        offsets = cols[None].expand(len(slots), -1)
        embeds = list(contexts) if blocks is None else [torch.cat([c, b]) for c, b in zip(contexts, blocks)]
        base = [self.runner.lengths[s] for s in slots]
        at = None
        if blocks is not None:  # block positions first_draft .. size - 1: the drafts
            first = self.drafter.first_draft
            at = torch.tensor([[len(c) + j for j in range(first, size)] for c in contexts], dtype=torch.long)
        self.drafter.columns.context = (is_ctx | ~in_row).to(device, non_blocking=True)[..., None]
        try:
            out = self.runner.forward(slots, [[0] * n for n in lengths], at, layout=(mask, offsets), embeds=embeds)
        finally:
            self.drafter.columns.context = None
        for s, b, c in zip(slots, base, contexts):
            self.runner.set_length(s, b + len(c))  # the context is kept, the block never
        return out if blocks is not None else None


# -- the spec -----------------------------------------------------------------------------------------------
def _bind(drafter: DFlashDrafter, ctx) -> DFlashDrafter:
    target = ctx.target
    return ctx.place(drafter.bind(target.decoder.embed_tokens, target.lm_head, target.num_layers))


def _build(ctx) -> DFlashProposer:
    drafter = _bind(ctx.resource, ctx)  # in-memory drafters too: the target's dtype, device and depth
    runner = ctx.runner_for(drafter, extra_capacity=drafter.block_size + 1)
    return DFlashProposer(drafter, runner, ctx.vocab_size)


def _load(path: str, ctx) -> DFlashDrafter:
    return _bind(DFlashDrafter.load(path, ctx.target.hidden_size, ctx.target.num_layers), ctx)


def _inspect(path: str, target) -> dict:
    """The drafter's layout against the target: widths, every tensor's shape, its taps, the mask token."""
    drafter = DFlashDrafter.load(path, target.hidden_size, target.num_layers, described=True)
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ValueError(f"its mask token {drafter.mask_token_id} is outside the target's vocabulary ({target.vocab_size})")
    return {}


def _facts(drafter: DFlashDrafter) -> dict:
    return {"block_size": drafter.block_size}


def _offline_facts(path: str) -> dict:
    raw = json.loads((pathlib.Path(path) / "config.json").read_text())
    return {"block_size": int((raw.get("dflash_config") or {}).get("block_size", raw.get("block_size", DEFAULT_BLOCK)))}


def check_block_tokens(options, most: int, block: str) -> None:
    """An explicit ``num_speculative_tokens`` no more than the ``most`` a block drafts (``block``
    names it in the message)."""
    if "num_speculative_tokens" in options.model_fields_set and options.num_speculative_tokens > most:
        raise ValueError(f"speculation.num_speculative_tokens: {options.num_speculative_tokens} exceeds the {most} "
                         f"tokens {block} drafts")


def _check(options: DFlashOptions, facts: dict, limits) -> None:
    most = facts.get("block_size", DEFAULT_BLOCK) - 1
    check_block_tokens(options, most, f"a DFlash block of {most + 1}")


register_method(MethodSpec(
    name="dflash",
    options=DFlashOptions,
    build=_build,
    needs_features=True,
    placement="target",
    checkpoint="dflash",
    recipe="specray.training.dflash",
    requirement="a DFlash drafter (EngineConfig.checkpoints['dflash'] / --dflash DIR; `specray train dflash`)",
    load=_load,
    facts=_facts,
    offline_facts=_offline_facts,
    check=_check,
    feature_layers=lambda drafter: drafter.layer_ids,
    inspect=_inspect,
    block=True,
))
