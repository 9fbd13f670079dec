"""Fixed-shape forwards over a runner's KV cache: the graph-safe step.

``ModelRunner.forward`` (eager) builds each forward's shapes from the host: the batch
as it is, the widest row, the longest row's keys, and it skips the mask when it can. A
captured graph cannot do that. :class:`StaticForward` runs the same model over the same
cache with every shape fixed by a key:

    batch  rows, padded up to a bucket (1, 2, 4, 8, ...); padding rows write into the
           cache's scratch slot and are never read
    width  new tokens per row (1 = decode, 1 + k = a chain, T = a tree), padded rows
           write into their scratch position
    kv     keys attended to, rounded up to a block: attention reads at most one block
           more than the longest row needs

and computes everything that depends on the rows' lengths on the device, from small
index tensors: write positions, position ids and the additive mask (prefix + chain or
tree). Nothing in the function reads a tensor back or branches on a value, so it can be

* ``eager`` — run as is (the CPU reference of the static path),
* ``compile`` — ``torch.compile(dynamic=True, fullgraph=True)``: one graph for every
  batch, width and kv size (dynamo specializes sizes 0 and 1 only, so at most four
  variants per model), and no recompiles as lengths change (they are tensor values),
* ``graphs`` (CUDA) — the compiled function captured as a CUDA graph per (batch, width,
  kv) key on first use and replayed (vLLM and SGLang capture per batch size the same way).

The eager ``ModelRunner.forward`` stays the reference: tests check the static path
against it token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from specray.kernels import attention

log = logging.getLogger(__name__)

StepMode = Literal["eager", "static", "compile", "graphs"]
STEP_MODES = ("eager", "static", "compile", "graphs")
"""eager: ModelRunner.forward + host acceptance (the reference); static: fixed shapes,
device acceptance, one read-back per step, uncompiled; compile: the same compiled;
graphs: the same compiled and captured as CUDA graphs (CUDA only)."""

KV_BLOCK = 64  # keys are attended in multiples of this (fewer distinct shapes)


def batch_bucket(n: int, limit: int) -> int:
    """The padded batch size for n rows: the next power of two, at most ``limit``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max(limit, n))


@dataclass
class StaticOutput:
    """One fixed-shape forward (device tensors; rows past ``batch`` and positions past each
    row's width are padding).

    logits:  [Bb, W, V] float32 at every new position
    hidden:  [Bb, W, H] final-norm hidden states
    ids:     [Bb, W] the tokens run (device drafts spliced in)
    tree:    [Bb, W, W] bool, new token j sees new token i
    offsets: [Bb, W] position offsets (a tree's depths)
    rows:    [Bb] cache rows
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    ids: torch.Tensor
    tree: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor
    batch: int


class StaticForward:
    """The fixed-shape forward of one ``ModelRunner`` (it shares the runner's cache and
    host-side lengths; the eager ``forward`` and this one may alternate, e.g. prefill
    eager, decode static).

    >>> static = StaticForward(runner, "compile")                 # doctest: +SKIP
    >>> out = static.run([0, 3], [[7], [9]])                       # two rows decode
    """

    def __init__(self, runner, mode: StepMode = "static", kv_block: int = KV_BLOCK):
        if mode not in STEP_MODES or mode == "eager":
            raise ValueError(f"StaticForward mode must be one of static, compile, graphs; got {mode!r}")
        if mode == "graphs" and runner.device.type != "cuda":
            raise ValueError("mode 'graphs' captures CUDA graphs and needs a CUDA device; use 'compile' on CPU")
        self.runner, self.mode, self.kv_block = runner, mode, kv_block
        self.limit = runner.num_slots
        fn = self._forward
        if mode in ("compile", "graphs"):
            import torch._dynamo

            # Every runner compiles its own function; lift the per-code cache limit so two
            # models (draft and target) each keep their variants.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fn = torch.compile(self._forward, dynamic=True, fullgraph=True)
        self._fn = fn
        self._graphs: dict[tuple[int, int, int], _Captured] = {}
        self._pool = None

    # -- the pure fixed-shape function -------------------------------------------------
    def _forward(self, ids, lengths, q_lens, rows, tree_mask, offsets, kv_keys):
        """ids [Bb, W] int64; lengths [Bb] cached tokens per row; q_lens [Bb] new tokens per
        row; rows [Bb] cache rows; tree_mask [Bb, W, W] bool (new token j sees new token i);
        offsets [Bb, W] position offsets of the new tokens; kv_keys [kv] = arange(kv), whose
        length is the number of keys attended (a shape, not a value, so a compiled graph
        keeps it symbolic). Returns (logits [Bb, W, V] float32, hidden [Bb, W, H])."""
        runner = self.runner
        width = ids.shape[1]
        col = torch.arange(width, device=ids.device)
        valid = col[None, :] < q_lens[:, None]  # [Bb, W]
        positions = lengths[:, None] + offsets  # [Bb, W]
        write_pos = torch.where(valid, lengths[:, None] + col[None, :], runner.cache.scratch)
        mask = attention.batch_mask(lengths, kv_keys, tree_mask, runner.dtype)  # [Bb, 1, W, kv]
        ctx = attention.AttentionBatch(
            cache=runner.cache, rows=rows, contiguous=False, write_pos=write_pos, kv_len=kv_keys.shape[0],
            mask=mask, lengths=lengths, positions=positions, offsets=offsets,
        )
        hidden = runner._run_decoder(ids, positions, ctx)  # [Bb, W, H]
        return runner.logits(hidden), hidden

    # -- one forward ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        spliced: Sequence[tuple[torch.Tensor, int, torch.Tensor]] = (),
    ) -> StaticOutput:
        """Append ``tokens[i]`` to ``slots[i]`` and run the model at a fixed shape.

        layout:  (mask [B, q, q] bool, offsets [B, q]) as for ``ModelRunner.forward``; None
                 = chains.
        spliced: (rows [n] int64, column c, tokens [n, k] int64): device tensors written
                 into the inputs at those rows' columns c..c+k-1 (drafts made on the
                 device, never read back; ``tokens`` holds placeholders there).
        Host lengths advance by len(tokens[i]), as the eager forward's do.
        """
        runner = self.runner
        batch = len(slots)
        q_lens = [len(t) for t in tokens]
        lengths = [runner.lengths[s] for s in slots]
        for s, n, L in zip(slots, q_lens, lengths):
            if n < 1 or L + n > runner.capacity:
                raise ValueError(f"slot {s}: {L} cached + {n} new tokens must fit capacity {runner.capacity}")
        width = max(q_lens)
        rows_b = batch_bucket(batch, self.limit)
        kv = min(-(-(max(L + n for L, n in zip(lengths, q_lens))) // self.kv_block) * self.kv_block,
                 runner.capacity + 1)
        inputs = self._host_inputs(slots, tokens, q_lens, lengths, layout, rows_b, width)
        device = runner.device
        dev = [t.to(device, non_blocking=True) for t in inputs]
        for rows, col, toks in spliced:  # device drafts
            dev[0][rows, col : col + toks.shape[1]] = toks
        kv_keys = torch.arange(kv, device=device)
        if self.mode == "graphs":
            logits, hidden = self._replay((rows_b, width, kv), dev, kv_keys)
        else:
            logits, hidden = self._fn(*dev, kv_keys)
        for s, n in zip(slots, q_lens):
            runner.lengths[s] += n
        ids, _, _, rows, tree, offsets = dev
        return StaticOutput(logits, hidden, ids, tree, offsets, rows, batch)

    def _host_inputs(self, slots, tokens, q_lens, lengths, layout, rows_b, width):
        """The small index tensors of one forward, built on the host (one copy each)."""
        scratch = self.runner.num_slots  # the cache's padding row
        ids = torch.zeros(rows_b, width, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        pad = rows_b - len(slots)
        lens = torch.tensor(list(lengths) + [0] * pad, dtype=torch.long)
        q = torch.tensor(list(q_lens) + [width] * pad, dtype=torch.long)
        rows = torch.tensor(list(slots) + [scratch] * pad, dtype=torch.long)
        if layout is None:
            tree = torch.ones(width, width, dtype=torch.bool).tril().expand(rows_b, -1, -1).contiguous()
            offsets = torch.arange(width).expand(rows_b, -1).contiguous()
        else:
            tree = torch.eye(width, dtype=torch.bool).repeat(rows_b, 1, 1)
            offsets = torch.arange(width).repeat(rows_b, 1)
            m, o = layout
            tree[: len(slots), : m.shape[1], : m.shape[2]] = m  # host tensors (engine/step.py)
            offsets[: len(slots), : o.shape[1]] = o
        return ids, lens, q, rows, tree, offsets

    # -- CUDA graphs -----------------------------------------------------------------------
    def _replay(self, key, dev, kv_keys):
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(dev, kv_keys)
            log.info("captured a CUDA graph for batch %d, width %d, %d keys (%d graphs)", *key, len(self._graphs))
        for buf, new in zip(graph.inputs, dev):
            buf.copy_(new, non_blocking=True)
        graph.graph.replay()
        return graph.outputs

    def _capture(self, dev, kv_keys) -> "_Captured":
        inputs = [t.clone() for t in dev] + [kv_keys.clone()]
        # Warm up on a side stream (compilation, allocator, kernels' lazy init), then
        # capture; every graph of this runner shares one memory pool.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._fn(*inputs)
        return _Captured(graph, inputs[:-1], outputs)


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: list[torch.Tensor]  # the static buffers new inputs are copied into
    outputs: tuple[torch.Tensor, torch.Tensor]
