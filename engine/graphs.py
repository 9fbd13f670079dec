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

* ``static`` — run as is (the CPU reference of the static path),
* ``compile`` — ``torch.compile(dynamic=True, fullgraph=True)``: one graph for every
  batch, width and kv size, and no recompiles as lengths change (they are tensor values).
  Dynamo specializes sizes 0 and 1, so compiled forwards pad batch and width to at least
  2: one variant per model, compiled once,
* ``cudagraph`` (CUDA) — the uncompiled function captured as a CUDA graph per (batch,
  width, kv) key on first use and replayed (vLLM and SGLang capture per batch size the
  same way),
* ``graphs`` (CUDA) — the compiled function captured the same way.

The same forward serves feature-level heads (EAGLE, EAGLE-3: ``inputs`` fuses each token with
the feature it is fed on inside the graph) and trees built on the device (``run(trees=...)``:
EAGLE-2's and ReDrafter's, whose structure the host never reads).

The eager ``ModelRunner.forward`` stays the reference: tests check the static path
against it token for token.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from specray.kernels import attention
from specray.kernels.logits import fit_vocab
from specray.kernels.sampling import probs_from_logits, sample_from_uniform
from specray.policies.compiled import compiled, inference

log = logging.getLogger(__name__)

StepMode = Literal["eager", "static", "compile", "cudagraph", "graphs"]
STEP_MODES = ("eager", "static", "compile", "cudagraph", "graphs")
"""eager: ModelRunner.forward + host acceptance (the reference); static: fixed shapes,
device acceptance, one read-back per step, uncompiled; compile: the same compiled;
cudagraph: static captured as CUDA graphs; graphs: compiled and captured (CUDA only)."""
COMPILED = ("compile", "graphs")
CAPTURED = ("cudagraph", "graphs")

KV_BLOCK = 64  # keys are attended in multiples of this (fewer distinct shapes)
INPUT_SHAPES = 32  # input buffers kept per runner (a step's shapes, reused every step)


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
    layers:  {k: [Bb, W, H]} the hidden states entering decoder layer k, for the runner's
             tapped layers (``StaticForward.layers``)
    ids:     [Bb, W] the tokens run (device drafts spliced in)
    tree:    [Bb, W, W] bool, new token j sees new token i
    offsets: [Bb, W] position offsets (a tree's depths)
    rows:    [Bb] cache rows
    after:   what the forward's ``epilogue`` computed from them inside the graph (empty
             without one)
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    layers: dict[int, torch.Tensor]
    ids: torch.Tensor
    tree: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor
    batch: int
    after: tuple[torch.Tensor, ...] = ()


class StaticForward:
    """The fixed-shape forward of one ``ModelRunner`` (it shares the runner's cache and
    host-side lengths; the eager ``forward`` and this one may alternate, e.g. prefill
    eager, decode static).

    >>> static = StaticForward(runner, "compile")                 # doctest: +SKIP
    >>> out = static.run([0, 3], [[7], [9]])                       # two rows decode
    """

    def __init__(self, runner, mode: StepMode = "static", kv_block: int = KV_BLOCK, layers: Sequence[int] = (),
                 inputs=None, epilogue=None):
        if mode not in STEP_MODES or mode == "eager":
            raise ValueError(f"StaticForward mode must be one of {', '.join(STEP_MODES[1:])}; got {mode!r}")
        if mode in CAPTURED and runner.device.type != "cuda":
            raise ValueError(f"mode {mode!r} captures CUDA graphs and needs a CUDA device; use 'compile' on CPU")
        self.runner, self.mode, self.kv_block = runner, mode, kv_block
        self.layers = tuple(sorted(set(layers)))  # decoder layers whose inputs every forward returns (EAGLE-3's taps)
        self._taps = _Layers(self.layers, runner.num_layers)
        # inputs(ids [Bb, W], feats [Bb, W, F]) -> [Bb, W, H] input embeddings, computed inside
        # the graph from the features ``run`` is given (a feature-level head's input fusion)
        self.inputs = inputs
        # epilogue(ids, tree_mask, offsets, sizes [Bb], logits) -> tensors, run inside the graph
        # after the logits (the target's acceptance, ``engine/device_step.py``): one compiled
        # call a step, not a second one with wrappers of its own around a small graph.
        # ``run`` is then given each row's draft size (its own input, as a tree's extra
        # tokens make it no function of the row's width).
        self.epilogue = epilogue
        self.limit = runner.num_slots
        # Compiled forwards never see a batch or width of 1 (see the module docstring).
        self.compiled = mode in COMPILED
        self.min_size = 2 if self.compiled else 1
        fn = self._forward
        if mode in COMPILED:
            import torch._dynamo

            # Dynamo caches compiled code per code object: give each runner (draft, target) a
            # copy of _forward's, so that each model compiles once and neither shows up as a
            # recompile of the other.
            own = types.FunctionType(StaticForward._forward.__code__.replace(), globals(), "_forward",
                                     StaticForward._forward.__defaults__)
            fn = types.MethodType(own, self)
            # No "duck sizing": a batch of 2 must not be tied to a width of 2, or to the cache's
            # 2 kv heads, which would recompile when either changes.
            torch.fx.experimental._config.use_duck_shape = False
            # The KV cache never changes shape: static, or every buffer's dims become symbols of
            # their own (with duck sizing off), which slowed tracing and every call's guards, and
            # each symbol is one more argument the C++ wrapper turns into a tensor per call. The
            # paged cache's block table is part of it.
            table = getattr(runner.cache, "table", None)
            for buf in (*getattr(runner.cache, "keys", ()), *getattr(runner.cache, "values", ()),
                        *(() if table is None else (table,))):
                torch._dynamo.mark_static(buf)
            # The model's modules never change after start-up, so their guards are skipped:
            # checking every parameter on each call cost more than a small model's forward.
            fn = compiled(fn, runner.device)
        self._fn = fn
        self._graphs: dict[tuple[int, int, int], _Captured] = {}
        self._chains: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (Bb, W) -> chain layout
        self._kv_keys: dict[int, torch.Tensor] = {}
        self._chain_fns: dict[tuple[int, int, bool], object] = {}  # (steps, vocab, sampled) -> a drafting chain
        self._pool = None
        # (Bb, W, sized) -> the inputs' buffers (``_host_inputs``); bounded, as a head's
        # catch-up over a prompt runs at the prompt's width
        self._input_buffers = functools.lru_cache(maxsize=INPUT_SHAPES)(self._new_input_buffers)

    # -- the pure fixed-shape function -------------------------------------------------
    def _forward(self, ids, lengths, q_lens, rows, tree_mask, offsets, kv_keys, *extra):
        """ids [Bb, W] int64; lengths [Bb] cached tokens per row; q_lens [Bb] new tokens per
        row; rows [Bb] cache rows; tree_mask [Bb, W, W] bool (new token j sees new token i);
        offsets [Bb, W] position offsets of the new tokens; kv_keys [kv] = arange(kv), whose
        length is the number of keys attended (a shape, not a value, so a compiled graph
        keeps it symbolic); extra: feats [Bb, W, F] when given (the inputs are then
        ``self.inputs(ids, feats)`` instead of the ids' embeddings), then sizes [Bb] when the
        forward has an ``epilogue``. Returns (logits [Bb, W, V] float32, hidden [Bb, W, H],
        the tapped layers' inputs, one [Bb, W, H] each, then the epilogue's outputs)."""
        runner = self.runner
        feats = extra[0] if len(extra) > (self.epilogue is not None) else None
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
        taps: dict[int, torch.Tensor] = {}
        embeds = None if feats is None else self.inputs(ids, feats)  # [Bb, W, H]
        hidden = runner._run_decoder(ids, positions, ctx, embeds, self._taps, taps,
                                     unroll=self.mode not in COMPILED)  # [Bb, W, H]
        logits = runner.logits(hidden)
        after = () if self.epilogue is None else self.epilogue(ids, tree_mask, offsets, extra[-1], logits)
        return (logits, hidden, *taps.values(), *after)  # taps in layer order (self.layers is sorted)

    # -- one forward ---------------------------------------------------------------------
    @inference
    def run(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        spliced: Sequence[tuple[torch.Tensor, int, torch.Tensor]] = (),
        feats: torch.Tensor | None = None,
        trees: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
        sizes: Sequence[int] | None = None,
    ) -> StaticOutput:
        """Append ``tokens[i]`` to ``slots[i]`` and run the model at a fixed shape.

        layout:  (mask [B, q, q] bool, offsets [B, q]) as for ``ModelRunner.forward``; None
                 = chains.
        spliced: (rows [n] int64 or a slice, column c, tokens [n, k] int64): device
                 tensors written into the inputs at those rows' columns c..c+k-1 (drafts
                 made on the device, never read back; ``tokens`` holds placeholders there).
        feats:   [B, q, F] device features the runner's ``inputs`` turns into the input
                 embeddings inside the graph (right-padded like ``tokens``; a head's inputs).
        trees:   (rows [n] int64, mask [n, T, T] bool, offsets [n, T] int64): trees built on
                 the device, written into ``layout`` at those rows' nodes 1..T (the root's
                 row and column as ``layout`` has them: every node sees the root).
        sizes:   each row's draft nodes, for the ``epilogue`` (default: all but the root).
        Host lengths advance by len(tokens[i]), as the eager forward's do.
        """
        if self.epilogue is not None and sizes is None:
            sizes = [len(t) - 1 for t in tokens]
        batch = len(slots)
        q_lens, rows_b, width, kv, (ids, lens, q, rows, *sized) = self._prepare(
            slots, tokens, 0, sizes if self.epilogue is not None else None)
        for r, col, toks in spliced:  # device drafts
            ids[r, col : col + toks.shape[1]] = toks
        if layout is None:  # chains: constant per shape, built once
            if trees:
                raise ValueError("trees built on the device need a layout (their rows are trees)")
            tree, offsets = self._chain(rows_b, width)
        else:
            tree, offsets = self._tree(layout, rows_b, width)
        for r, m, o in trees:  # device trees
            tree[r, 1 : 1 + m.shape[1], 1 : 1 + m.shape[1]] = m
            offsets[r, 1 : 1 + o.shape[1]] = o
        dev = [ids, lens, q, rows, tree, offsets]
        extra = []
        if feats is not None:  # [B, q, F] -> [Bb, W, F]
            padded = feats.new_zeros(rows_b, width, feats.shape[-1])
            padded[:batch, : feats.shape[1]] = feats
            extra.append(padded)
        extra += sized
        if self.mode in CAPTURED:
            logits, hidden, *rest = self._replay((rows_b, width, kv, len(extra)), dev, self._keys(kv), extra)
            # The graph rewrites its outputs at its next replay: features handed to proposers
            # (kept across steps) get memory of their own; logits and the epilogue's outputs
            # are read before then.
            hidden = hidden.clone()
            rest = [t.clone() for t in rest[: len(self.layers)]] + rest[len(self.layers):]
        else:
            logits, hidden, *rest = self._fn(*dev, self._keys(kv), *extra)
        for s, n in zip(slots, q_lens):
            self.runner.lengths[s] += n
        taps, after = rest[: len(self.layers)], tuple(rest[len(self.layers):])
        return StaticOutput(logits, hidden, dict(zip(self.layers, taps)), ids, tree, offsets, rows, batch, after)

    # -- drafting in one call ----------------------------------------------------------------
    def _draft_chain(self, ids, lengths, q_lens, rows, tree_mask, offsets, kv_keys, sampling=None, steps=1, vocab=1):
        """A draft model's chain: the forward of ``ids`` (each row's pending tokens), then
        ``steps - 1`` one-token forwards, each fed the token drawn after the last: the argmax
        of the logits over the target's ``vocab`` (a longer draft head cut to it, a shorter
        one padded), or, where ``sampling`` = (uniforms [Bb, steps], temperature [Bb], top_k
        [Bb], top_p [Bb], drawn [Bb] bool) marks a row drawn, a draw from its processed
        distribution. ``steps`` and ``vocab`` are constants of the compiled graph, one graph
        per (steps, vocab, sampled or not). Returns the tokens [Bb, steps], and with
        ``sampling`` also the distributions [Bb, steps, vocab]."""
        forward = StaticForward._forward  # inlined into this graph, not the compiled one
        logits = forward(self, ids, lengths, q_lens, rows, tree_mask, offsets, kv_keys)[0]
        batch = ids.shape[0]
        last = logits[torch.arange(batch, device=ids.device), q_lens - 1]  # [Bb, V_draft]
        lengths = lengths + q_lens
        one = torch.ones_like(lengths)
        sees = torch.ones(batch, 1, 1, dtype=torch.bool, device=ids.device)
        at = torch.zeros(batch, 1, dtype=torch.long, device=ids.device)
        drawn, probs = [], []
        for j in range(steps):
            if j:  # the last token drawn is not fed
                last = forward(self, drawn[-1][:, None], lengths, one, rows, sees, at, kv_keys)[0][:, 0]
                lengths = lengths + 1
            fitted = fit_vocab(last, vocab)
            token = fitted.argmax(dim=-1)  # [Bb]
            if sampling is not None:
                u, temperature, top_k, top_p, sampled = sampling
                q = probs_from_logits(fitted, temperature, top_k, top_p, check=False)  # [Bb, vocab]
                token = torch.where(sampled, sample_from_uniform(q, u[:, j]), token)
                probs.append(q)
            drawn.append(token)
        tokens = torch.stack(drawn, dim=1)
        return tokens if sampling is None else (tokens, torch.stack(probs, dim=1))

    def chains(self) -> bool:
        """Whether ``chain`` serves this runner: a whole model (not a tensor-parallel shard, whose
        other ranks hold no logits to draw the next token from) outside CUDA graphs (which
        capture the one-forward step)."""
        # (a mirror wraps ``run`` on the instance: read there, not through a bound method each call)
        return self.epilogue is None and self.mode not in CAPTURED and not getattr(self.__dict__.get("run"), "_mirrored", False)

    @inference
    def chain(self, slots: Sequence[int], tokens: Sequence[Sequence[int]], steps: int, vocab: int,
              sampling: Sequence[torch.Tensor] | None = None):
        """Drafting in one call: append ``tokens[i]`` to ``slots[i]``, draw a token after each
        row's last one, feed it, and so on until ``steps`` tokens are drawn (the last one is
        not fed). Greedy rows draw the argmax over the first ``vocab`` logits; with
        ``sampling`` = (uniforms [n, steps], temperature [n], top_k [n], top_p [n], drawn [n]
        bool), the rows marked drawn sample. Returns device tokens [n, steps] (and with
        ``sampling`` the distributions [n, steps, vocab]); host lengths advance by
        ``len(tokens[i]) + steps - 1``. Under ``compile`` it is one compiled call (a graph per
        ``steps``), not ``steps`` calls, each with the wrappers a compiled call pays on the
        host."""
        if not self.chains():
            raise ValueError("chain() needs a whole model outside CUDA graphs (see chains())")
        n = len(slots)
        q_lens, rows_b, width, kv, (ids, lens, q, rows) = self._prepare(slots, tokens, steps - 1)
        tree, offsets = self._chain(rows_b, width)
        key = (steps, vocab, sampling is not None)
        fn = self._chain_fns.get(key)
        if fn is None:
            code = StaticForward._draft_chain.__code__.replace()  # a code object per graph (see __init__)
            fn = types.MethodType(types.FunctionType(code, globals(), "_draft_chain", (None, steps, vocab)), self)
            if self.compiled:
                fn = compiled(fn, self.runner.device)
            self._chain_fns[key] = fn
        if sampling is not None:  # padding rows: greedy, with parameters that keep the draw well defined
            fill = (0.0, 1.0, 0, 1.0, False)
            sampling = tuple(torch.cat([t, t.new_full((rows_b - n, *t.shape[1:]), v)]) if rows_b > n else t
                             for t, v in zip(sampling, fill))
            drafted, probs = fn(ids, lens, q, rows, tree, offsets, self._keys(kv), sampling)
        else:
            drafted = fn(ids, lens, q, rows, tree, offsets, self._keys(kv))
        for s, m in zip(slots, q_lens):
            self.runner.lengths[s] += m + steps - 1
        return drafted[:n] if sampling is None else (drafted[:n], probs[:n])

    def _prepare(self, slots, tokens, more: int, sizes=None):
        """Checks, paged blocks and the device inputs of a forward that appends ``tokens`` to
        ``slots`` and then ``more`` tokens per row (a drafting chain's): the rows' new-token
        counts, the padded batch and width, the keys attended and the host-built inputs."""
        runner = self.runner
        q_lens = [len(t) for t in tokens]
        lengths = [runner.lengths[s] for s in slots]
        for s, n, L in zip(slots, q_lens, lengths):
            if n < 1 or L + n + more > runner.capacity:
                raise ValueError(f"slot {s}: {L} cached + {n + more} new tokens must fit capacity {runner.capacity}")
        ends = [L + n + more for L, n in zip(lengths, q_lens)]
        runner.reserve(slots, ends)  # paged: blocks for what it writes
        width = max(max(q_lens), self.min_size)
        rows_b = max(batch_bucket(len(slots), self.limit), self.min_size)
        kv = min(-(-max(ends) // self.kv_block) * self.kv_block, runner.capacity + 1)
        return q_lens, rows_b, width, kv, self._host_inputs(slots, tokens, q_lens, lengths, rows_b, width, sizes)

    def _host_inputs(self, slots, tokens, q_lens, lengths, rows_b, width, sizes=None):
        """ids [Bb, W], lengths, new-token counts and cache rows [Bb] (and the draft sizes
        [Bb] when given): one int64 buffer per shape, written on the host in one numpy
        assignment (and copied to the device once), the inputs its views, made once: slicing a
        fresh buffer into its inputs each call (a tensor slice from Python is a few us) cost more
        than the rest of this. The views are rewritten by the next forward of the same shape:
        a caller reads them before it runs another."""
        pad = rows_b - len(slots)
        values: list[int] = []
        for row in tokens:
            values += row
            values += [0] * (width - len(row))
        n = rows_b * width
        values += [0] * (n - len(values))
        values += lengths
        values += [0] * pad
        values += q_lens
        values += [width] * pad
        values += slots
        values += [self.runner.num_slots] * pad  # padding rows: the scratch row
        if sizes is not None:
            values += sizes
            values += [0] * pad
        buf = self._input_buffers(rows_b, width, sizes is not None)
        buf.host[:] = values
        if buf.device is not None:  # pageable memory: the copy has read it when this returns
            buf.device.copy_(buf.source, non_blocking=True)
        return buf.views

    def _new_input_buffers(self, rows_b: int, width: int, sized: bool) -> "_InputBuffers":
        n = rows_b * width
        host = np.zeros(n + rows_b * (4 if sized else 3), dtype=np.int64)
        device = self.runner.device
        source = torch.from_numpy(host)  # the same memory
        on = source if device.type == "cpu" else torch.zeros(len(host), dtype=torch.long, device=device)
        views = [on[:n].view(rows_b, width)] + [on[at : at + rows_b] for at in range(n, len(host), rows_b)]
        return _InputBuffers(host, source, None if device.type == "cpu" else on, views)

    def _chain(self, rows_b: int, width: int):
        key = (rows_b, width)
        hit = self._chains.get(key)
        if hit is None:
            device = self.runner.device
            tree = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(rows_b, -1, -1).contiguous()
            offsets = torch.arange(width, device=device).expand(rows_b, -1).contiguous()
            hit = self._chains[key] = (tree, offsets)
        return hit

    def _tree(self, layout, rows_b: int, width: int):
        m, o = layout  # host tensors (engine/step.py), [B, q, q] and [B, q]
        tree = torch.eye(width, dtype=torch.bool).repeat(rows_b, 1, 1)
        offsets = torch.arange(width).repeat(rows_b, 1)
        tree[: m.shape[0], : m.shape[1], : m.shape[2]] = m
        offsets[: o.shape[0], : o.shape[1]] = o
        device = self.runner.device
        return tree.to(device, non_blocking=True), offsets.to(device, non_blocking=True)

    def _keys(self, kv: int) -> torch.Tensor:
        keys = self._kv_keys.get(kv)
        if keys is None:
            keys = self._kv_keys[kv] = torch.arange(kv, device=self.runner.device)
        return keys

    # -- CUDA graphs -----------------------------------------------------------------------
    def _replay(self, key, dev, kv_keys, extra=()):
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(dev, kv_keys, extra)
            log.info("captured a CUDA graph for batch %d, width %d, %d keys (%d graphs)", *key[:3], len(self._graphs))
        for buf, new in zip(graph.inputs, [*dev, *extra]):
            buf.copy_(new, non_blocking=True)
        graph.graph.replay()
        return graph.outputs

    def _capture(self, dev, kv_keys, extra=()) -> "_Captured":
        # A graph reads its inputs at the addresses it was captured with, so every tensor it
        # reads must live as long as it does: the copied-into buffers (held by _Captured) and
        # kv_keys (self._keys' own, never freed). A clone of kv_keys freed after capture was
        # reused by the allocator, and every later replay masked with whatever it then held.
        inputs = [t.clone() for t in dev] + [kv_keys] + [t.clone() for t in extra]
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
        return _Captured(graph, inputs[: len(dev)] + inputs[len(dev) + 1 :], outputs)


class _Layers:
    """The tapped layers as the graph reads them: membership by flags. Under dynamic=True a
    tuple of ints read from an object becomes symbolic (``k in layers`` is then never true,
    and no dict lookup by one works); bools stay constants."""

    def __init__(self, layers: Sequence[int], num_layers: int):
        self.ids = tuple(layers)
        self.flags = tuple(k in self.ids for k in range(num_layers))

    def __contains__(self, k: int) -> bool:
        return self.flags[k]

    def __iter__(self):
        return iter(self.ids)

    def __bool__(self) -> bool:
        return bool(self.ids)


@dataclass
class _InputBuffers:
    host: np.ndarray  # [Bb * W + Bb * (3 or 4)] int64, the values written each call
    source: torch.Tensor  # host as a tensor (its memory)
    device: torch.Tensor | None  # its device copy (None on the CPU: the inputs view host's memory)
    views: list[torch.Tensor]  # ids [Bb, W], lengths, q_lens, rows (, sizes) [Bb]


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: list[torch.Tensor]  # the static buffers new inputs are copied into
    outputs: tuple[torch.Tensor, ...]  # (logits, hidden, *taps)
