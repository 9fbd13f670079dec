"""Drafter versions in one engine: which version of each learnable drafter serves, the swap
between steps, and versions read from / written to the method's public layout.

**Swap semantics: rebuild.** A new version's weights are copied *in place* into the serving
module between two steps (the tensors a compiled or captured step reads stay the same
objects), and every running request's drafter state is then rebuilt from what the engine
keeps, so from the next step on every row drafts with the new version as if it had served the
request from its start:

* the draft model's KV cache from the request's committed tokens (its slots are released and
  its proposer catches up from ``ProposalRow.token_ids`` at the next draft, as it does for any
  slot that is behind);
* a feature-level head's (EAGLE, EAGLE-3: a KV cache over (feature, next token) pairs;
  Medusa, ReDrafter: the last feature) from the target's features of every committed token,
  which the engine keeps per running request while versions can change (``_Log``: F floats
  per token, what the head's commit hands it anyway).

One version per method per engine at any step, so a step's drafts all come from one version;
drafts are only proposals, so output stays exactly the target's (greedy identical, sampling
exact) through any swap.
"""

from __future__ import annotations

import copy
import json
import logging
import pathlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from specray.engine.capture import capture_kind
from specray.engine.runner import ModelRunner
from specray.policies.base import CommitRow, PrefillRow
from specray.policies.registry import ProposerContext, method_spec

log = logging.getLogger(__name__)

BASE = "base"


@dataclass
class DrafterVersion:
    """A drafter's weights as one version.

    state:    the trainable module's tensors (``weights_module``), on the CPU
    measured: what its gate measured (``mean_accepted_length``, ``rates``: per draft position
              P(accepted | the one before accepted), ``serving_accepted_length``, ...)
    """

    method: str
    version: str
    state: dict[str, torch.Tensor]
    measured: dict = field(default_factory=dict)
    parent: str | None = None
    created: float = field(default_factory=time.time)

    def describe(self) -> dict:
        """Everything but the weights (status, listings)."""
        return {"method": self.method, "version": self.version, "measured": dict(self.measured),
                "parent": self.parent, "created": self.created}


def base_version(method: str) -> str:
    return f"{method}@{BASE}"


def weights_module(resource) -> nn.Module:
    """The module whose parameters a version replaces: a draft model's (HF causal-LM keys,
    ``model.*`` and ``lm_head.*``), or the head itself (its own keys; the target's embedding
    and LM head it binds are not its parameters)."""
    if isinstance(resource, ModelRunner):
        return nn.ModuleDict({"model": resource.decoder, "lm_head": resource.lm_head})
    if isinstance(resource, nn.Module):
        return resource
    raise TypeError(f"{type(resource).__name__} holds no drafter weights")


def forget_prefixes(resource, proposer) -> None:
    """The drafter's cached KV blocks (paged KV's prefix cache) dropped: new weights made them
    stale, or the engine's prefix cache is reset."""
    for runner in (resource, getattr(proposer, "runner", None)):
        if isinstance(runner, ModelRunner):
            runner.forget_prefixes()


def snapshot(resource) -> dict[str, torch.Tensor]:
    """The resource's weights as a CPU copy (a version's ``state``)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in weights_module(resource).state_dict().items()}


def clone_resource(resource):
    """A copy of a drafter's weights module that shares what it only binds (the target's
    embedding and LM head, held outside its registered submodules)."""
    module = weights_module(resource)
    own = set(map(id, module.modules()))
    memo = {}
    for value in vars(module).values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, nn.Module) and id(item) not in own:
                memo[id(item)] = item
                memo.update({id(p): p for p in item.parameters()})
    return copy.deepcopy(module, memo)


@dataclass
class Blueprint:
    """What a trainer needs to rebuild a drafter away from the engine (another process, a
    device of its own): its module with the serving weights, on the CPU, in float32 — a
    draft model's Hugging Face causal LM, or the head without what it binds of the target —
    and those bound parts of the target, frozen: its token embedding and LM head [V, H]."""

    method: str
    version: str
    module: nn.Module
    embed: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None
    target_layers: int = 0
    vocab_size: int = 0


def blueprint(method: str, version: str, resource, target: ModelRunner) -> Blueprint:
    if isinstance(resource, ModelRunner):
        from transformers import AutoModelForCausalLM

        # A config of its own: the serving model's names specray's attention, which it keeps.
        module = AutoModelForCausalLM.from_config(copy.deepcopy(resource.config))
        module.load_state_dict(snapshot(resource))
        module.set_attn_implementation("sdpa")  # trained as a plain HF model
        return Blueprint(method, version, module.float().eval(), vocab_size=target.vocab_size)
    module = clone_resource(resource)
    own = set(map(id, module.modules()))
    for name, value in list(vars(module).items()):  # unbind: the trainer binds CPU copies
        if isinstance(value, tuple) and value and all(isinstance(x, nn.Module) and id(x) not in own for x in value):
            setattr(module, name, ())
    cpu = lambda t: t.detach().to("cpu", torch.float32, copy=True)  # noqa: E731
    return Blueprint(method, version, module.to("cpu", torch.float32).eval(), cpu(target.decoder.embed_tokens.weight),
                     cpu(target.lm_head.weight), target.num_layers, target.vocab_size)


def read_version(method: str, directory: str, context: ProposerContext, version: str | None = None) -> DrafterVersion:
    """A version from a directory in the method's public layout (as its checkpoint loads)."""
    spec = method_spec(method)
    if capture_kind(method) is None or spec.load is None:
        raise ValueError(f"method {method!r} has no drafter weights to load")
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise ValueError(f"{directory}: no such directory")
    if spec.checkpoint == "draft":  # a causal LM: its weights, without a KV cache for it
        from transformers import AutoModelForCausalLM

        state = {k: v.detach().cpu() for k, v in AutoModelForCausalLM.from_pretrained(str(path)).state_dict().items()}
    else:
        state = snapshot(spec.load(str(path), context))
    return DrafterVersion(method, version or f"{method}@{path.name}", state, {"source": str(path)})


def write_version(v: DrafterVersion, resource, directory: str) -> str:
    """Save ``v`` in its method's public layout (a draft model as a Hugging Face checkpoint,
    heads as their ``save`` writes them), shaped like the serving ``resource``."""
    out = pathlib.Path(directory)
    if isinstance(resource, ModelRunner):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(copy.deepcopy(resource.config))
        model.load_state_dict(v.state)
        model.save_pretrained(out)
    else:
        clone = clone_resource(resource)
        clone.load_state_dict(v.state)
        clone.save_pretrained(out) if hasattr(clone, "save_pretrained") else clone.save(out)
    (out / "specray_version.json").write_text(json.dumps(v.describe(), indent=2))
    return str(out)


@dataclass
class _Log:
    """A running request's committed tokens and the target's features at positions 0..L-2."""

    tokens: list[int]
    features: list[torch.Tensor]


class DrafterVersions:
    """The serving version of each learnable method in one engine, a step tap (it keeps the
    running requests' features for rebuilding), and the swap.

    proposers: the engine's ``ProposerTable``; length_policy: the speculation-length policy
    (the self-tuning controller starts a new version from its measured acceptance).
    """

    def __init__(self, proposers, methods: Sequence[str], length_policy=None):
        self.proposers, self.length_policy = proposers, length_policy
        self.methods = [m for m in methods if capture_kind(m) is not None]
        self.serving: dict[str, str] = {m: base_version(m) for m in self.methods}
        self.measured: dict[str, dict] = {m: {} for m in self.methods}
        self.history: list[dict] = [{"time": time.time(), "method": m, "version": v} for m, v in self.serving.items()]
        self._live: dict[str, set[int]] = {m: set() for m in self.methods}
        self._logs: dict[int, _Log] = {}
        self._swapped: dict[str, DrafterVersion] = {}  # the last version swapped in, per method
        self.checkpoint_of = lambda method: None  # method -> its weights dir (set by the engine)

    # -- taps ------------------------------------------------------------------------------
    def prefilled(self, reqs, logits) -> None:
        pass

    def verified(self, reqs, logits, paths, emitted) -> None:
        pass

    def handed_over(self, method: str, rows: Sequence[CommitRow | PrefillRow]) -> None:
        if method not in self._live:
            return
        keep = method_spec(method).needs_features
        for row in rows:
            self._live[method].add(row.slot)
            if not keep:
                continue
            if isinstance(row, PrefillRow):
                self._logs[row.slot] = _Log(list(row.token_ids) + [row.first_token], [row.features])
            elif row.slot in self._logs:
                entry = self._logs[row.slot]
                entry.tokens += list(row.tokens)
                entry.features.append(row.features)

    def released(self, slots) -> None:
        for s in slots:
            self._logs.pop(s, None)
            for live in self._live.values():
                live.discard(s)

    # -- the swap --------------------------------------------------------------------------
    def swap(self, v: DrafterVersion) -> None:
        """Serve ``v`` from the next step on (call between steps)."""
        if v.method not in self.serving:
            raise ValueError(f"method {v.method!r} is not a learnable drafter loaded here "
                             f"(loaded: {sorted(self.serving)})")
        proposer = self.proposers.get(v.method)
        if proposer is None:
            raise ValueError(f"method {v.method!r} has no proposer here")
        if hasattr(proposer, "load_version"):  # in a worker of its own: it swaps and rebuilds there
            proposer.load_version(v.state)
        else:
            module = weights_module(self.proposers.resources[v.method])
            with torch.no_grad():
                module.load_state_dict(v.state)  # copy_ into the serving tensors
            forget_prefixes(self.proposers.resources[v.method], proposer)
            self._rebuild(v.method, proposer)
        self.serving[v.method] = v.version
        self.measured[v.method] = dict(v.measured)
        self._swapped[v.method] = v
        self.history.append({"time": time.time(), "method": v.method, "version": v.version})
        rates = v.measured.get("rates")
        if rates and hasattr(self.length_policy, "start_method"):
            self.length_policy.start_method(v.method, rates)
        log.info("drafter %s now serves %s (%d running requests rebuilt)", v.version, v.method, len(self._live[v.method]))

    def _rebuild(self, method: str, proposer) -> None:
        live = sorted(self._live[method])
        for slot in live:
            proposer.release(slot)
        if method_spec(method).needs_features:
            rows = [PrefillRow(s, e.tokens[:-1], e.tokens[-1], torch.cat(e.features)[: len(e.tokens) - 1])
                    for s, e in ((s, self._logs.get(s)) for s in live) if e is not None]
            if rows:
                proposer.prefill(rows)

    def current(self, method: str) -> DrafterVersion:
        """The serving version of ``method`` with its weights (to export, or to train from)."""
        return DrafterVersion(method, self.serving[method], snapshot(self.proposers.resources[method]),
                              dict(self.measured[method]))

    def stamp(self, requests) -> None:
        """Mark each request with the version its method is served by this step (metrics)."""
        for r in requests:
            version = self.serving.get(r.method)
            if version is not None:
                r.metrics.drafter_version = version

    def blueprint(self, method: str) -> Blueprint:
        """``method``'s serving drafter for a trainer (``Blueprint``); a draft model in a worker of
        its own is read from its checkpoint, with the last version swapped in."""
        target = self.proposers.context.target
        if method in self.proposers.resources:
            return blueprint(method, self.serving[method], self.proposers.resources[method], target)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.checkpoint_of(method), dtype=torch.float32)
        if method in self._swapped:
            model.load_state_dict(self._swapped[method].state)
        model.set_attn_implementation("sdpa")
        return Blueprint(method, self.serving[method], model.eval(), vocab_size=target.vocab_size)

    def status(self) -> dict:
        return {"serving": dict(self.serving), "measured": {m: dict(x) for m, x in self.measured.items()},
                "history": list(self.history[-64:])}
