"""ModelRunner: any ``AutoModelForCausalLM`` over a slot-indexed KV cache.

One ``forward`` serves prefill, decode and verification: each row appends its own
number of new tokens after its own cached length. Rollback is ``set_length`` — the
rejected slots are overwritten by later writes, nothing is recomputed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from specray.engine.architectures import check_architecture
from specray.engine.kv_blocks import BlockPool, BlockTables, PagingConfig
from specray.engine.llama_layers import run_layer, unrolled
from specray.kernels import attention

log = logging.getLogger(__name__)

# Decoders whose forward is embed -> rotary -> layers -> norm and nothing else (no
# embedding scale; per-layer mask types are the attention function's business: each layer
# passes its own sliding_window), so the runner may loop over the layers itself. Anything
# else goes through the model's own forward.
DIRECT_LAYER_LOOP = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class ForwardOutput:
    """logits: [B, m, V] float32 at the requested positions; hidden: [B, m, H] (final norm)
    at the same positions; features: [B, q, H] final-norm hidden states of every new token
    (only when asked for: feature-level drafters read them); layers: {k: [B, q, H]} the
    residual stream entering decoder layer k at every new token, for each k asked for (EAGLE-3
    reads three such taps)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    features: torch.Tensor | None = None
    layers: Mapping[int, torch.Tensor] | None = None


def final_softcap(config) -> float | None:
    """The model's final logit soft-cap (Gemma 2's ``final_logit_softcapping``), or None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "final_logit_softcapping", None)


def head_logits(lm_head, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """[..., H] final hidden states -> [..., V] float32 logits, soft-capped where the model caps
    them (the one logit step past the LM head that the served architectures have)."""
    logits = lm_head(hidden).float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits


class ModelRunner:
    """Owns a causal LM and its KV cache of ``num_slots`` rows of up to ``capacity`` tokens.

    paging: None = every row holds its whole context (one contiguous block per row); else
        the cache is paged (``engine/kv_blocks.py``): rows take fixed-size blocks from one
        pool as they grow, and may start from cached prefixes (``attach``). ``shift``: tokens
        past an entry that entry depends on (1 for EAGLE-style heads), for prefix keys.

    >>> runner = ModelRunner(model, num_slots=4, capacity=512)   # doctest: +SKIP
    >>> out = runner.forward([0, 1], [[5, 6, 7], [8]])           # two prompts
    >>> runner.set_length(0, 2)                                   # roll row 0 back
    """

    def __init__(self, model, num_slots: int, capacity: int, paging: PagingConfig | None = None, shift: int = 0):
        if num_slots < 1 or capacity < 2:
            raise ValueError(f"need num_slots >= 1 and capacity >= 2, got {num_slots}, {capacity}")
        check_architecture(model.config, capacity)
        model.set_attn_implementation(attention.register())
        model.eval()
        self.config = model.config
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.capacity = capacity
        # The compute dtype: the first parameter not stored in FP8 (FP8 layers hold float8 weights).
        param = next(p for p in model.parameters() if p.element_size() > 1)
        self.device, self.dtype = param.device, param.dtype
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        shard = getattr(model, "tensor_parallel", None)  # split over ranks: this rank's KV heads only
        kv_heads = shard.kv_heads if shard is not None else kv_heads
        self.num_layers = layers = text_config.num_hidden_layers
        self.paging, self.blocks = paging, None
        if paging is None:
            # +1 row: scratch for the padding rows of fixed-shape batches; +1 position: scratch
            # for padding tokens within a row.
            shape = (num_slots + 1, kv_heads, capacity + 1, head_dim)
            self.cache = attention.LayerCache(
                keys=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
                values=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
            )
        else:
            bs = paging.block_size
            num_blocks = paging.blocks_for(num_slots, capacity)
            shape = (num_blocks + 1, bs, kv_heads, head_dim)  # +1 block: scratch
            # Each row's table reaches its scratch position (capacity); the last row is the
            # padding rows' (all scratch).
            table = torch.full((num_slots + 1, capacity // bs + 1), num_blocks, dtype=torch.long, device=self.device)
            self.cache = attention.PagedCache(
                keys=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
                values=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
                table=table, capacity=capacity,
            )
            self.blocks = BlockTables(BlockPool(num_blocks, paging.prefix_caching), table, bs, shift)
        self.num_slots = num_slots
        self.static = None  # a StaticForward once enable_static() is called
        self.lengths = [0] * num_slots  # cached tokens per slot (host-side ints)
        # The LM head's input width: the final hidden state's (OPT projects it below hidden_size).
        self.hidden_size = getattr(self.lm_head, "in_features", None) or text_config.hidden_size
        self.softcap = final_softcap(self.config)
        self.vocab_size = self.lm_head.weight.shape[0]
        self._direct = text_config.model_type in DIRECT_LAYER_LOOP and all(
            hasattr(self.decoder, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")
        )
        # Llama layers run unrolled (engine/llama_layers.py: the same ops, without the module calls).
        self._unrolled = unrolled(self.decoder) if self._direct else None

    # -- lengths (rollback is an integer) --------------------------------------------
    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.capacity:
            raise ValueError(f"slot {slot}: length {length} outside [0, {self.capacity}]")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0
        if self.blocks is not None:
            self.blocks.free(slot)

    # -- paged KV: blocks and cached prefixes (no-ops / nothing cached when not paged) -------
    def reserve(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Give each slot blocks for positions 0..length-1 (``KVCacheFull`` if the pool runs
        out; slots served before that keep theirs). Forwards reserve what they write."""
        if self.blocks is None:
            return
        try:
            for slot, n in zip(slots, lengths):
                self.blocks.ensure(slot, n)
        finally:
            self.blocks.sync()

    def cached_prefix(self, token_ids: Sequence[int], limit: int) -> int:
        """Tokens of token_ids[:limit] this cache could start a row with (whole blocks)."""
        if self.blocks is None:
            return 0
        return self.blocks.cached(token_ids, limit) * self.blocks.block_size

    def attach(self, slot: int, token_ids: Sequence[int], tokens: int) -> int:
        """Start ``slot`` afresh holding the cached blocks of token_ids' first ``tokens``
        tokens (a multiple of the block size, at most ``cached_prefix``); returns its length."""
        self.reset(slot)
        if self.blocks is None:
            return 0
        # (with tokens 0 too: the lookup counts as a prefix-cache query)
        self.lengths[slot] = self.blocks.attach(slot, token_ids, max(tokens, 0) // self.blocks.block_size)
        self.blocks.sync()
        return self.lengths[slot]

    def forget_prefixes(self) -> None:
        """The weights changed (a new drafter version): no cached block may be reused, and no
        row's blocks are published again (rows are rebuilt from scratch)."""
        if self.blocks is not None:
            self.blocks.forget()

    def publishes(self, slot: int, num_tokens: int) -> bool:
        """Whether ``publish`` of the slot's ``num_tokens`` tokens would cache a block now."""
        return self.blocks is not None and self.blocks.publishes(slot, num_tokens, self.lengths[slot])

    def publish(self, slot: int, token_ids: Sequence[int]) -> None:
        """The slot's cached positions hold token_ids' entries: its full blocks may be reused
        by rows that start with the same tokens."""
        if self.blocks is not None:
            self.blocks.publish(slot, token_ids, self.lengths[slot])

    # -- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        logits_at: torch.Tensor | None = None,
        layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        features: bool = False,
        embeds: Sequence[torch.Tensor] | None = None,
        layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Append ``tokens[i]`` to ``slots[i]``'s cache and run the model.

        logits_at: [B, m] int64 indices into each row's new tokens (clamped to the row);
                   None = the last new token of each row (m = 1).
        layout:    (mask [B, q, q] bool, offsets [B, q] int64) for any per-row structure
                   of the new tokens — a tree, beams, a lookahead window beside candidate
                   n-grams (rows padded with self-only nodes): new token j attends to new
                   token i iff mask[b, j, i] (and to the whole cached prefix), and sits at
                   position length + offsets[b, j]. None = a chain (causal). After
                   acceptance, ``keep`` moves the accepted path into consecutive slots; the
                   rest (rejected nodes, window tokens) is never kept.
        features:  also return every new token's final hidden state ([B, q, H]).
        embeds:    [B][q_i, H] input embeddings to use instead of the token ids' (a
                   feature-level drafter feeding fused features); ``tokens`` then only
                   give the rows' lengths.
        layers:    also return the hidden states entering these decoder layers (0 = the
                   embeddings' output, as HF's ``output_hidden_states[k]``; k < num layers).
        Lengths advance by len(tokens[i]); callers roll back with ``set_length``/``keep``.
        """
        q_lens = [len(t) for t in tokens]
        q = max(q_lens)
        if any(not 0 <= k < self.num_layers for k in layers):
            raise ValueError(f"layers {list(layers)}: the model has decoder layers 0..{self.num_layers - 1}")
        if min(q_lens) < 1:
            raise ValueError("every row needs at least one new token")
        lengths = [self.lengths[s] for s in slots]
        for s, n, L in zip(slots, q_lens, lengths):
            if L + n > self.capacity:
                raise ValueError(f"slot {s}: {L} cached + {n} new tokens exceeds capacity {self.capacity}")
        self.reserve(slots, [L + n for L, n in zip(lengths, q_lens)])
        ctx, ids, pos_ids = self._batch(slots, tokens, q_lens, q, lengths, layout)
        inputs = None
        if embeds is not None:  # right-padded [B, q, H], like the ids
            inputs = torch.zeros(len(slots), q, embeds[0].shape[-1], dtype=self.dtype, device=self.device)
            for i, e in enumerate(embeds):
                inputs[i, : e.shape[0]] = e
        taps: dict[int, torch.Tensor] = {}  # {k: [B, q, H]}, filled for ``layers``
        hidden = self._run_decoder(ids, pos_ids, ctx, inputs, layers, taps)  # [B, q, H]
        for s, n in zip(slots, q_lens):
            self.lengths[s] += n

        last = torch.tensor(q_lens, dtype=torch.long)[:, None] - 1  # [B, 1]
        idx = last if logits_at is None else torch.minimum(logits_at, last)  # [B, m]
        idx = idx.to(self.device)
        picked = hidden.gather(1, idx[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, m, H]
        return ForwardOutput(logits=self.logits(picked), hidden=picked, features=hidden if features else None,
                             layers=taps if layers else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final hidden states -> [..., V] float32 logits (soft-capped if the model does)."""
        return head_logits(self.lm_head, hidden, self.softcap)

    def _batch(self, slots, tokens, q_lens, q, lengths, layout=None):
        """Attention context, input ids [B, q] and position ids [B, q] for one forward."""
        batch = len(slots)
        uniform = min(q_lens) == q
        lens_t = torch.tensor(lengths, dtype=torch.long)
        positions = lens_t[:, None] + torch.arange(q, dtype=torch.long)  # [B, q]
        if uniform:  # the common decode/verify case: no padding
            ids = torch.tensor(tokens, dtype=torch.long)
            write_pos = pos_ids = positions
        else:
            ids = torch.zeros(batch, q, dtype=torch.long)
            for i, t in enumerate(tokens):
                ids[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
            q_t = torch.tensor(q_lens, dtype=torch.long)
            valid = torch.arange(q)[None, :] < q_t[:, None]  # [B, q]
            # Padding writes go to the scratch slot and take the row's last position id.
            write_pos = torch.where(valid, positions, torch.full_like(positions, self.cache.scratch))
            pos_ids = torch.minimum(positions, (lens_t + q_t - 1)[:, None])
        kv_len = max(L + n for L, n in zip(lengths, q_lens))
        tree_mask = offsets = None
        if layout is not None:  # small index tensors: built on the CPU, moved once below
            tree_mask, offsets = (t if t.device.type == "cpu" else t.cpu() for t in layout)
            pos_ids = lens_t[:, None] + offsets
        if q == 1 and min(lengths) == max(lengths):
            mask = None  # every row sees all kv_len keys
        else:
            mask = attention.causal_batch_mask(lens_t, q, kv_len, self.dtype, tree_mask).to(self.device)
        ctx = attention.AttentionBatch(
            cache=self.cache,
            rows=torch.tensor(list(slots), dtype=torch.long, device=self.device),
            contiguous=list(slots) == list(range(batch)),
            write_pos=write_pos.to(self.device),
            kv_len=kv_len,
            mask=mask,
            lengths=lens_t,  # for sliding-window layers' masks, built only if a layer asks
            positions=pos_ids,
            offsets=offsets,
        )
        return ctx, ids.to(self.device), pos_ids.to(self.device)

    def _run_decoder(self, ids, pos_ids, ctx, inputs=None, layers=(), taps=None, unroll=True) -> torch.Tensor:
        """Final-norm hidden states [B, q, H]; ``taps[k]`` = [B, q, H] entering layer k, for k in ``layers``.

        unroll: Llama layers run unrolled where they can (``engine/llama_layers.py``); a compiled
        forward passes False, as its graph has no module calls to save, and dynamo compiled the
        unrolled layers far more slowly (seen on the demo target).

        For architectures whose decoder forward is exactly embed -> rotary -> layers ->
        norm, the layers are called directly: transformers' wrapper (mask creation,
        output capturing) costs as much as a layer of these small models per step.
        """
        if not self._direct:
            given = {"inputs_embeds": inputs} if inputs is not None else {"input_ids": ids}
            out = self.decoder(**given, position_ids=pos_ids, use_cache=False, specray_batch=ctx,
                               output_hidden_states=bool(layers))
            for k in layers:
                taps[k] = out.hidden_states[k]
            return out.last_hidden_state
        dec = self.decoder
        hidden = dec.embed_tokens(ids) if inputs is None else inputs
        rope = dec.rotary_emb(hidden, position_ids=pos_ids)
        fast = self._unrolled if unroll else None
        for k, layer in enumerate(dec.layers):
            if k in layers:
                taps[k] = hidden
            if fast is not None:
                hidden = run_layer(fast[k], hidden, rope[0], rope[1], ctx)
            else:
                hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=pos_ids,
                               specray_batch=ctx)
        return dec.norm(hidden)


    def keep(self, kept: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """After verification: for each (slot, base, path) keep only the accepted path.

        base is the cache length before the verify forward (where its root was written);
        path the kept node indices, root first. A chain's path 0..n is already in place (a
        length change); a tree's or window's path is compacted. Rollback of everything else
        is the length: later writes overwrite it.
        """
        for slot, base, path in kept:
            self.set_length(slot, base)
            self.compact([slot], [path])

    @torch.inference_mode()
    def compact(self, slots: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        """Keep an accepted tree path: move its nodes' KV into consecutive slots.

        Call after ``set_length(slot, base)``, base being the cache length before the
        tree forward (where its root was written). kept[i] are the path's node indices,
        root first (offsets from base); they land at base, base+1, ... and the length
        advances by len(kept[i]).
        """
        for slot, nodes in zip(slots, kept):
            base = self.lengths[slot]
            if any(n != i for i, n in enumerate(nodes)):  # else the path already sits in place
                src = torch.tensor([[base + n for n in nodes]], device=self.device)
                dst = torch.arange(base, base + len(nodes), device=self.device)[None]
                self.cache.move(torch.tensor([slot], device=self.device), src, dst)
            self.lengths[slot] = base + len(nodes)

    @torch.inference_mode()
    def compact_paths(self, rows: torch.Tensor, bases: torch.Tensor, paths: torch.Tensor,
                      num_accepted: torch.Tensor) -> None:
        """``compact`` for a whole batch on the device, without reading anything back.

        rows [B] cache rows; bases [B] where each root was written; paths [B, W] kept node
        indices by depth (valid up to num_accepted [B]). Node path[j] moves to base + j;
        entries past a row's path copy its scratch position onto itself. Host lengths are
        the caller's (it learns the counts from the step's read-back).
        """
        width = paths.shape[1]
        col = torch.arange(width, device=paths.device)
        keep = col[None, :] <= num_accepted[:, None]  # [B, W]
        scratch = self.cache.scratch
        src = torch.where(keep, bases[:, None] + paths, scratch)  # [B, W]
        dst = torch.where(keep, bases[:, None] + col[None, :], scratch)
        self.cache.move(rows, src, dst)

    def enable_static(self, mode: str, layers: Sequence[int] = (), inputs=None, epilogue=None) -> None:
        """Serve fixed-shape forwards (``engine/graphs.py``) beside the eager one; ``layers``:
        the decoder layers whose inputs every fixed-shape forward also returns; ``inputs``:
        a head's input fusion, run inside the graph; ``epilogue``: what the graph computes
        from its logits (the target's acceptance) (``StaticForward``)."""
        from specray.engine.graphs import StaticForward

        self.static = StaticForward(self, mode, layers=layers, inputs=inputs, epilogue=epilogue)


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               quantization: str | None = None, fp8_kernel: str = "dequantize"):
    """Load a Hugging Face causal LM checkpoint directory (or hub id, if online).

    An architecture specray cannot serve exactly is refused before its weights load. A checkpoint
    published in FP8 loads as stored; ``quantization="fp8"`` quantizes any other one's linear
    layers at load (``engine/quantization.py``), on the CPU before the model moves to ``device``,
    so the device only ever holds the FP8 weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specray.engine import quantization as Q
    from specray.kernels.fp8 import scaled_mm_problem

    Q.check_method(quantization)
    if fp8_kernel == "scaled_mm" and (problem := scaled_mm_problem(device)):
        raise Q.UnsupportedQuantizationError(f"fp8_kernel scaled_mm: {problem}; use fp8_kernel dequantize")
    config = AutoConfig.from_pretrained(path)
    check_architecture(config)
    stored = Q.stored_fp8(getattr(config, "quantization_config", None))
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if stored is not None:  # transformers' own FP8 loaders want a GPU (and fbgemm): load the values, then swap
        del config.quantization_config
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the scales are "unexpected keys" to transformers: read below
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype,
                                                         attn_implementation=attention.register())
        finally:
            hf_logging.set_verbosity(verbosity)
        Q.load_stored_fp8(model, path, stored, fp8_kernel)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attention.register())
        if quantization == "fp8":
            Q.quantize_linears(model, fp8_kernel)
    model = model.to(device)
    log.info("%s: %s", path, Q.describe(model) if stored is None else f"{stored.describe()}; {Q.describe(model)}")
    return model
