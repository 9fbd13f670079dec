"""Attention over a slot-indexed KV cache with per-row lengths.

specray registers :func:`cached_attention` with transformers' ``AttentionInterface``
under the name ``"specray"``. The model computes q/k/v (with RoPE at the positions we
pass) for the *new* tokens only; this function writes the new keys/values into the
cache at each row's own offset, then attends over ``[cached prefix | new tokens]`` with
one additive mask built once per forward (see :class:`AttentionBatch`). Prefill, decode,
chain verification and tree verification (Medusa, EAGLE, ReDrafter, lookahead) differ
only in that mask: a dense ``[B, 1, q, kv_len]`` float mask in which each row sees its own
cached prefix (rows differ in length) and its new tokens under the causal or tree mask;
keys past them (up to the longest row's) are masked.

CUDA: ``xformers.ops.memory_efficient_attention`` with that mask as an explicit attention
bias, where a start-up probe saw its CUDA kernels run (``kernels/backends.py``; xformers is
optional). Otherwise (CPU, no working xformers, or ``SPECRAY_ATTENTION=sdpa``):
``torch.nn.functional.scaled_dot_product_attention`` with the same mask.
tests/test_gpu.py compares the two where CUDA is available (it skips on the CPU).

Per-layer conventions arrive as keyword arguments from the model's attention module, as
they do for transformers' own functions: ``sliding_window`` (the layer sees only keys
within that many positions, transformers' ``key_pos > query_pos - window``: Mistral,
Qwen2/3 with ``use_sliding_window``, Phi-3, Gemma 2/3 ...) narrows the mask
(:meth:`AttentionBatch.mask_for`), and ``softcap`` (Gemma 2's ``attn_logit_softcapping``)
switches to :func:`softcapped_attention`, the one path that caps scores before the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specray.kernels.backends import attention_backend

ATTENTION_NAME = "specray"


@dataclass
class LayerCache:
    """K/V buffers of every layer, one contiguous row per slot: [num_slots, H_kv, capacity + 1, D]
    each (the paging off layout: every row holds its whole context).

    The last position of each row is scratch: writes of padding tokens go there, so a
    padded row can never overwrite a valid key of its own.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def scratch(self) -> int:
        return self.keys[0].shape[2] - 1

    def plan(self, rows: torch.Tensor, pos: torch.Tensor, kv_len: int, contiguous: bool):
        """What every layer's write and read of one forward share (computed once per forward):
        rows [B] cache rows, pos [B, q] the new tokens' positions, kv_len keys read per row,
        contiguous: rows are 0..B-1 (reads are views)."""
        return rows, pos, kv_len, contiguous

    def write(self, layer: int, plan, key: torch.Tensor, value: torch.Tensor) -> None:
        """key/value [B, H_kv, q, D] into the plan's positions."""
        rows, pos, _, _ = plan
        # Advanced indices (rows, positions) around a slice put their dims first:
        # buf[rows[:, None], :, pos] has shape [B, q, H_kv, D].
        self.keys[layer][rows[:, None], :, pos] = key.transpose(1, 2)
        self.values[layer][rows[:, None], :, pos] = value.transpose(1, 2)

    def read(self, layer: int, plan):
        """Keys and values of positions 0..kv_len-1 of each row: [B, H_kv, kv_len, D] each."""
        rows, _, kv_len, contiguous = plan
        k_buf, v_buf = self.keys[layer], self.values[layer]
        if contiguous:  # rows 0..B-1: views, no gather
            batch = rows.shape[0]
            return k_buf[:batch, :, :kv_len], v_buf[:batch, :, :kv_len]
        return k_buf[rows, :, :kv_len], v_buf[rows, :, :kv_len]

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy each row's positions src [B, W] onto dst [B, W], every layer (a kept tree path)."""
        for buf in (*self.keys, *self.values):
            buf[rows[:, None], :, dst] = buf[rows[:, None], :, src]  # advanced-index read copies first


@dataclass
class PagedCache:
    """K/V buffers of every layer in fixed-size blocks: [num_blocks + 1, block_size, H_kv, D]
    each, and a block table mapping each row's positions to blocks.

    table: [num_rows + 1, max_blocks] int64 on the device; row r's position p lives in block
           table[r, p // block_size] at offset p % block_size. Entries a row has not been
           given point at the scratch block (the last one), as does the whole last row (the
           padding row of fixed-shape batches). Host code (``engine/kv_blocks.py``) owns which
           blocks a row holds; this class only addresses them.
    capacity: positions per row; position ``capacity`` is scratch (padding tokens write there)
           and never holds a token, so a block holding it is never full or shared.

    Reads gather each row's blocks with one ``index_select`` per buffer: a block is
    ``block_size`` consecutive positions of every head, so the rows' blocks laid end to end
    are [B, kv, H_kv, D] as they are, and attention reads them through a transposed view
    (one copy, against three for a [.., H_kv, block_size, D] block measured on these CPUs).
    On the CPU SDPA then runs over the gathered keys, as over the contiguous layout's.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    table: torch.Tensor
    capacity: int

    @property
    def block_size(self) -> int:
        return self.keys[0].shape[1]

    @property
    def scratch(self) -> int:
        return self.capacity

    @property
    def scratch_block(self) -> int:
        return self.keys[0].shape[0] - 1

    def _where(self, rows: torch.Tensor, pos: torch.Tensor):
        """rows [B], pos [B, q] -> (blocks [B, q], offsets [B, q])."""
        bs = self.block_size
        return self.table[rows[:, None], torch.div(pos, bs, rounding_mode="floor")], pos % bs

    def plan(self, rows: torch.Tensor, pos: torch.Tensor, kv_len: int, contiguous: bool):
        """The new tokens' (blocks, offsets) [B, q] and the blocks every row reads, laid end to
        end ([B * n], n = blocks covering kv_len): the same for every layer of a forward."""
        bs = self.block_size
        n = (kv_len + bs - 1) // bs
        blocks, offsets = self._where(rows, pos)
        return blocks, offsets, self.table[rows, :n].reshape(-1), rows.shape[0], n, kv_len

    def write(self, layer: int, plan, key: torch.Tensor, value: torch.Tensor) -> None:
        blocks, offsets = plan[0], plan[1]
        self.keys[layer][blocks, offsets] = key.transpose(1, 2)  # [B, q, H_kv, D]
        self.values[layer][blocks, offsets] = value.transpose(1, 2)

    def read(self, layer: int, plan):
        _, _, gathered, batch, n, kv_len = plan
        bs = self.block_size

        def gather(buf):  # [B * n, bs, H_kv, D] -> [B, H_kv, kv_len, D] (a view)
            g = buf.index_select(0, gathered)
            return g.view(batch, n * bs, g.shape[2], g.shape[3])[:, :kv_len].transpose(1, 2)

        return gather(self.keys[layer]), gather(self.values[layer])

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        src_b, src_o = self._where(rows, src)
        dst_b, dst_o = self._where(rows, dst)
        for buf in (*self.keys, *self.values):
            buf[dst_b, dst_o] = buf[src_b, src_o]  # advanced-index read copies first


@dataclass
class AttentionBatch:
    """Everything one forward's attention layers share (built once, read per layer).

    rows:       [B] int64 slot ids
    contiguous: rows are 0..B-1, so reads are views instead of gathers
    write_pos:  [B, q] int64 cache positions of the new tokens (padding -> scratch)
    kv_len:     keys attended to per row (max over rows of length + new tokens)
    mask:       [B, 1, q, kv_len] additive float mask (0 attend, finfo.min masked), or
                None when every row attends to all kv_len keys
    lengths:    [B] int64 cached tokens per row before this forward   } what sliding-window
    positions:  [B, q] int64 position ids of the new tokens           } layers need to
    offsets:    [B, q] int64 new tokens' position offsets (a tree), or } narrow the mask
                None for a chain (new token i sits at lengths + i)     } (``mask_for``)
    """

    cache: LayerCache | PagedCache
    rows: torch.Tensor
    contiguous: bool
    write_pos: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None
    lengths: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _plan: object = field(default=None, repr=False)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer that sees only keys within ``window`` positions (None: all).

        Built once per window size and forward, on top of ``mask``; a query keeps a key iff
        key_pos > query_pos - window, transformers' sliding-window rule, with positions (not
        cache indices) so that tree nodes at equal depth see the same window.
        """
        if window is None or self.kv_len <= window:  # no query is window+ positions past key 0
            return self.mask
        mask = self._windowed.get(window)
        if mask is None:
            if self.lengths is None or self.positions is None:
                raise RuntimeError("a sliding-window layer needs the batch's lengths and positions")
            device = self.write_pos.device
            offsets = None if self.offsets is None else self.offsets.to(device)
            keys = key_positions(self.lengths.to(device), self.kv_len, offsets)  # [B, kv_len]
            outside = keys[:, None, :] <= self.positions.to(device)[:, :, None] - window  # [B, q, kv_len]
            base = self.mask
            if base is None:
                dtype = self.cache.keys[0].dtype
                base = torch.zeros(outside.shape[0], 1, *outside.shape[1:], dtype=dtype, device=device)
            mask = base.masked_fill(outside[:, None], torch.finfo(base.dtype).min)
            self._windowed[window] = mask
        return mask

    def update_and_read(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Write this forward's key/value [B, H_kv, q, D]; return cached [B, H_kv, kv_len, D]."""
        if self._plan is None:  # where to write and what to read: once per forward, not per layer
            self._plan = self.cache.plan(self.rows, self.write_pos, self.kv_len, self.contiguous)
        self.cache.write(layer, self._plan, key, value)
        return self.cache.read(layer, self._plan)


def causal_batch_mask(
    lengths: torch.Tensor, query_len: int, kv_len: int, dtype: torch.dtype, tree_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Additive mask for new tokens appended after each row's cached prefix.

    lengths:   [B] cached tokens per row before this forward
    tree_mask: [B, q, q] bool or None. None: the new tokens are a chain (query j sees
               new tokens 0..j). Else query j sees new token i iff tree_mask[b, j, i]
               (its ancestors in a token tree, and itself).
    returns:   [B, 1, q, kv_len]; every query also sees the row's whole cached prefix.
    Padding queries see a causal pattern (finite garbage, never read back).
    """
    keys = torch.arange(kv_len, device=lengths.device)
    if tree_mask is not None:
        return batch_mask(lengths, keys, tree_mask, dtype)
    limit = lengths[:, None] + torch.arange(1, query_len + 1, device=lengths.device)  # [B, q]
    allowed = keys[None, None, :] < limit[:, :, None]  # [B, q, kv_len]
    return _additive(allowed, dtype)


def batch_mask(lengths: torch.Tensor, keys: torch.Tensor, tree_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same mask from device tensors only, for fixed-shape (captured) forwards.

    lengths [B]; keys [kv] = arange(kv) (its length is the number of keys); tree_mask
    [B, q, q] bool (a chain is its lower triangle). Returns [B, 1, q, kv]: query j sees
    the row's cached prefix and new token i iff tree_mask[b, j, i].
    """
    q = tree_mask.shape[1]
    rel = keys[None, :] - lengths[:, None]  # [B, kv], offset into the new tokens
    in_new = (rel >= 0) & (rel < q)
    idx = rel.clamp(0, q - 1)[:, None, :].expand(-1, q, -1)  # [B, q, kv]
    allowed = (rel < 0)[:, None, :] | (in_new[:, None, :] & tree_mask.gather(2, idx))
    return _additive(allowed, dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [B, q, kv] bool -> [B, 1, q, kv]
    mask = torch.zeros_like(allowed, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def key_positions(lengths: torch.Tensor, kv_len: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Position of every cached key: [B, kv_len] int64.

    The cached prefix sits at its own index (accepted paths are compacted into consecutive
    slots); new token i sits at lengths + offsets[:, i] (a tree) or lengths + i (a chain).
    """
    keys = torch.arange(kv_len, device=lengths.device)[None, :].expand(lengths.shape[0], -1)  # [B, kv_len]
    if offsets is None:
        return keys
    q = offsets.shape[1]
    rel = keys - lengths[:, None]  # offset into the new tokens
    in_new = (rel >= 0) & (rel < q)
    tree_pos = lengths[:, None] + offsets.gather(1, rel.clamp(0, q - 1))
    return torch.where(in_new, tree_pos, keys)


def cached_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [B, H, q, D], key/value [B, H_kv, q, D].

    Returns (out [B, q, H, D], None). ``attention_mask`` from transformers is ignored:
    the mask comes with the ``specray_batch`` kwarg, narrowed for the layer's
    ``sliding_window`` if it has one; ``softcap`` caps the scores (Gemma 2).
    """
    batch: AttentionBatch | None = kwargs.get("specray_batch")
    if batch is None:
        raise RuntimeError(
            "the 'specray' attention implementation needs a specray_batch; "
            "run the model through specray.engine.runner.ModelRunner"
        )
    keys, values = batch.update_and_read(module.layer_idx, key, value)
    mask = batch.mask_for(kwargs.get("sliding_window"))
    softcap = kwargs.get("softcap")
    if softcap:  # neither SDPA nor xformers caps scores before the mask
        return softcapped_attention(query, keys, values, mask, scaling, softcap), None
    if query.is_cuda and _use_xformers():
        return xformers_attention(query, keys, values, mask, scaling), None
    return sdpa_attention(query, keys, values, mask, scaling, getattr(module, "num_key_value_groups", None)), None


def sdpa_attention(query, keys, values, mask, scaling, groups: int | None = None):
    """query [B, H, q, D], keys/values [B, H_kv, kv, D], mask [B, 1, q, kv] -> [B, q, H, D].

    groups: query heads per kv head, from the module's config (a plain int, so that a
    compiled graph with symbolic shapes never branches on a size); None = from the shapes.
    """
    gqa = (query.shape[1] != keys.shape[1]) if groups is None else groups != 1
    if query.is_cuda:
        with _sdpa_backends():
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def _sdpa_backends():
    """SDPA's CUDA kernels chosen on purpose: never cuDNN, which builds a new plan for every
    new shape (1.4-4.4 ms of host time per call in a decode loop whose key count grows each
    step, seen on an H100). With specray's additive mask the memory-efficient kernel serves;
    flash (no mask) and math stay allowed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])


def softcapped_attention(query, keys, values, mask, scaling, softcap: float):
    """Attention with scores capped as softcap * tanh(scores / softcap) before the mask.

    query [B, H, q, D], keys/values [B, H_kv, kv, D], mask [B, 1, q, kv] -> [B, q, H, D];
    the same operations, in the same order, as transformers' eager attention.
    """
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:  # GQA: kv head i serves query heads i*groups .. (i+1)*groups - 1
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale  # [B, H, q, kv]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values).transpose(1, 2).contiguous()


def xformers_attention(query, keys, values, mask, scaling):
    """The same contract as ``sdpa_attention``, computed by xformers' fused kernels (CUDA).
    Reached only where the start-up probe saw them run; xformers is the optional extra."""
    try:
        import xformers.ops as xops
    except ImportError as exc:
        raise ImportError("xformers attention needs the optional extra: pip install 'specray[xformers]' "
                          "(the build matching your torch and CUDA); without it SDPA serves") from exc

    b, h, q, d = query.shape
    kv = keys.shape[2]
    if keys.shape[1] != h:  # GQA: xformers' BMHK layout wants one K/V head per query head
        keys = keys.repeat_interleave(h // keys.shape[1], dim=1)
        values = values.repeat_interleave(h // values.shape[1], dim=1)
    bias = None
    if mask is not None:
        # xformers needs the bias' last dimension 8-aligned in memory: pad, then slice.
        padded = -(-kv // 8) * 8
        bias = torch.empty(b, h, q, padded, dtype=query.dtype, device=query.device)[..., :kv]
        bias.copy_(mask.expand(b, h, q, kv))
    return xops.memory_efficient_attention(
        query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_bias=bias, scale=scaling
    )


_XFORMERS: bool | None = None  # resolved once, outside any compiled graph (register())


def _use_xformers() -> bool:
    """xformers only where its CUDA kernels were seen to run (``kernels/backends.py``).

    The probe runs CUDA work and logging calls that torch.compile cannot trace, so it is
    resolved eagerly (``register``, when a model is loaded) and a compiled forward reads a
    plain module constant here."""
    global _XFORMERS
    if _XFORMERS is None:
        _XFORMERS = attention_backend("cuda")[0] == "xformers"
    return _XFORMERS


def _no_mask(*args, **kwargs):
    """specray builds its own masks (AttentionBatch.mask); transformers' is not needed."""
    return None


def register() -> str:
    """Register the attention (and a no-op mask) function with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, cached_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    if torch.cuda.is_available():
        _use_xformers()  # probe now: never inside a compiled forward
    return ATTENTION_NAME
