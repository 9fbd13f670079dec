"""The tensor-parallel control plane: rank 0 drives, the other ranks mirror its runner calls.

Rank 0 runs the step driver as a single-device engine does; its runners (the target, and a
draft model split at the target's size) are ``ModelRunner``s over its shard whose
state-changing calls are *mirrored*: each call is recorded as (runner, method, arguments) and
broadcast on the group's control channel, and every other rank (a ``Follower``) makes the
same call on its own shard. The ranks' runners therefore hold the same lengths and cache
layout, and their forwards meet in the same all-reduces. Nothing is returned: rank 0 alone
computes logits and runs acceptance, proposers and bookkeeping.

    MIRRORED   the runner calls followers repeat, in order (``MIRRORED`` below: lengths,
               compaction, paged KV's block reservations and prefix cache; a new
               state-changing runner method is one more name). Each rank's block pool then
               makes the same choices: its tables are rank 0's.
    COLLECTIVE those that run the model: sent at once, with every call queued before them;
               the others (lengths, compaction) wait for the next one, so a step costs one
               message (two with a prefill)

Arguments travel pickled; tensors on rank 0's device are copied to the host (a small index
tensor: a step's accepted paths, a device draft's tokens) and land on the follower's device.
``stats`` holds what the control plane cost rank 0 (messages, bytes, seconds) and each
follower (seconds between a message's arrival and the start of its work).
"""

from __future__ import annotations

import copy
import io
import logging
import operator
import time
from dataclasses import dataclass, field

import torch

from specray.engine.collectives import GroupLostError, Groups
from specray.engine.runner import ModelRunner, load_model
from specray.engine.tensor_parallel import SkippedHead, shard_model

log = logging.getLogger(__name__)

MIRRORED = ("forward", "set_length", "reset", "keep", "compact", "compact_paths", "enable_static", "static.run",
            "reserve", "attach", "publish", "forget_prefixes")  # the last four: paged KV's blocks
COLLECTIVE = frozenset({"forward", "static.run"})
_BUILD, _STOP = "__build__", "__stop__"


@dataclass
class ControlStats:
    """What the control plane cost: messages sent (rank 0) or received, their bytes, and the
    seconds spent encoding and sending (rank 0) or decoding and replaying queued calls."""

    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"messages": self.messages, "bytes": self.bytes, "seconds": self.seconds}


@dataclass(frozen=True)
class _OnDevice:
    """A tensor that lived on rank 0's accelerator: it goes to the receiving rank's."""

    tensor: torch.Tensor


def _copied(value, for_later: bool):
    """Arguments as they will be sent: device tensors to host copies (cloned on the device
    first when the call waits for a later message, as the caller may reuse its buffers)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            return _OnDevice(value.detach().clone() if for_later else value.detach())
        return value.detach().clone() if for_later else value
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v, for_later) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v, for_later) for k, v in value.items()}
    return value


def _to_host(value):
    if isinstance(value, _OnDevice):
        return _OnDevice(value.tensor.cpu())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    return value


def _landed(value, device: torch.device):
    if isinstance(value, _OnDevice):
        return value.tensor.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_landed(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _landed(v, device) for k, v in value.items()}
    return value


class Mirror:
    """Rank 0's side: records its runners' mirrored calls and broadcasts them."""

    def __init__(self, groups: Groups):
        self.groups = groups
        self.stats = ControlStats()
        self._queue: list = []
        self._depth = 0  # > 0 inside a mirrored call: the calls it makes itself are not sent again

    def install(self, runner: ModelRunner, name: str) -> ModelRunner:
        """Mirror ``runner``'s calls to the followers' runner ``name`` (wrapped on the instance)."""
        for method in MIRRORED:
            self._wrap(runner, name, method)
        return runner

    def build(self, name: str, source, load: dict, runner: dict) -> None:
        """Tell the followers to build runner ``name`` over ``source`` (a checkpoint path, loaded
        with ``load``'s arguments, or the whole model itself) with ``runner``'s arguments, split
        as rank 0's (start-up: not counted in ``stats``)."""
        self.groups.send([(name, _BUILD, (source, load, runner), {})])

    def stop(self) -> None:
        self.groups.send([("", _STOP, (), {})])
        self.groups.settle()

    def _wrap(self, runner, name: str, method: str) -> None:
        """Wrap ``method`` on its owner. An owner the runner does not have yet (runner.static) is
        made by ``enable_static``: its methods are wrapped when that call returns, so no other
        call on the step's path looks for owners."""
        owner_path, _, attr = method.rpartition(".")
        owner = operator.attrgetter(owner_path)(runner) if owner_path else runner
        if owner is None or getattr(getattr(owner, attr), "_mirrored", False):
            return
        fn = getattr(owner, attr)
        collective = method in COLLECTIVE

        def mirrored(*args, **kwargs):
            if self._depth == 0:
                self._record(name, method, args, kwargs, now=collective)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:
                if collective and self._depth == 1 and not isinstance(exc, GroupLostError):
                    self._probe(exc)
                raise
            finally:
                self._depth -= 1
                if method == "enable_static":  # it made (or remade) runner.static
                    for m in MIRRORED:
                        if "." in m:
                            self._wrap(runner, name, m)

        mirrored._mirrored = True
        setattr(owner, attr, mirrored)

    def _probe(self, error: RuntimeError) -> None:
        """After a forward failed: did the group break? A compiled forward's all-reduces are
        traced into its graph, so a peer that is gone surfaces as the transport's plain
        RuntimeError, not the eager path's GroupLostError. An empty message to the other ranks
        (they are back at their receive: a forward that raised here raised there too) tells:
        its broadcast fails when a peer is gone."""
        try:
            self.groups.send([])
            self.groups.settle()
        except GroupLostError as lost:
            raise lost from error

    def _record(self, name: str, method: str, args, kwargs, now: bool) -> None:
        start = time.perf_counter()
        self._queue.append((name, method, _copied(args, not now), _copied(kwargs, not now)))
        if now:
            calls, self._queue = _to_host(self._queue), []
            self.stats.bytes += self.groups.send(calls)
            self.stats.messages += 1
        self.stats.seconds += time.perf_counter() - start


class Follower:
    """A rank > 0: builds the runners rank 0 asks for over its own shard and repeats rank 0's
    mirrored calls on them, until rank 0 sends stop (``serve``).

    device: where this rank's shard lives.
    """

    def __init__(self, groups: Groups, device: str | torch.device = "cpu"):
        self.groups = groups
        self.device = torch.device(device)
        self.runners: dict[str, ModelRunner] = {}
        self.stats = ControlStats()

    def serve(self) -> None:
        """Repeat rank 0's calls until it says stop (or the group is lost: GroupLostError)."""
        while True:
            calls = self.groups.receive()
            if calls and calls[0][1] in (_BUILD, _STOP):  # start-up and shutdown: sent alone, not counted
                name, method, args, _ = calls[0]
                if method == _STOP:
                    return
                self._build(name, *args)
                continue
            start = time.perf_counter()
            self.stats.messages += 1
            for name, method, args, kwargs in calls:
                if method in COLLECTIVE:  # the control plane's part ends where the model's starts
                    self.stats.seconds += time.perf_counter() - start
                self._call(name, method, args, kwargs)

    def _call(self, name: str, method: str, args, kwargs) -> None:
        fn = operator.attrgetter(method)(self.runners[name])
        try:
            fn(*_landed(args, self.device), **_landed(kwargs, self.device))
        except GroupLostError:
            raise
        except Exception:  # noqa: BLE001 - rank 0 raised the same (same state, same checks) and serves on
            log.debug("mirrored %s.%s raised (as rank 0 did)", name, method, exc_info=True)

    def _build(self, name: str, source, load: dict, runner: dict) -> None:
        model = load_model(source, device="cpu", **load) if isinstance(source, str) else source.load()
        self.runners[name] = sharded_runner(model, self.groups, self.device, **runner)
        log.info("rank %d holds %s (%s)", self.groups.rank, name, model.tensor_parallel)
        built(self.groups)


def sharded_runner(model, groups: Groups, device, num_slots: int, capacity: int, paging=None,
                   shift: int = 0) -> ModelRunner:
    """``model`` (whole, on the CPU) cut to this rank's share, moved to ``device``, in a runner;
    ranks > 0 skip the LM head (rank 0 computes the logits)."""
    shard_model(model, groups)
    runner = ModelRunner(model.to(device), num_slots, capacity, paging, shift)
    if groups.rank > 0:
        runner.lm_head = SkippedHead()
    return runner


def built(groups: Groups) -> None:
    """Every rank holds its shard of the runner just built (a barrier: start-up waits here, so
    that a step never waits on a rank still loading)."""
    groups.all_reduce(torch.zeros(1, device=groups.device)).cpu()


@dataclass
class ShardedRunners:
    """The runner factory of rank 0 (``LLMEngine(runners=...)``): the target, and the draft
    model when ``draft_sharded``, split over the group and mirrored; anything else local.

    Models load whole on the CPU (``load``: the config's dtype, and its quantization for the
    role), are split, and only the shard moves to ``device``.
    """

    groups: Groups
    config: object  # the EngineConfig (resolved for this rank's device)
    mirror: Mirror = field(init=False)
    _paths: dict = field(default_factory=dict, init=False)

    def __post_init__(self):
        self.mirror = Mirror(self.groups)
        self.device = self.config.resolved_device

    @property
    def draft_sharded(self) -> bool:
        return self.config.draft_tensor_parallel_size > 1

    def load_args(self, name: str) -> dict:
        cfg = self.config
        return {"dtype": cfg.resolved_dtype, "fp8_kernel": cfg.fp8_kernel,
                "quantization": cfg.quantization if name == "target" else cfg.draft_quantization}

    def load(self, name: str, path: str):
        model = load_model(path, device="cpu" if self._sharded(name) else self.device, **self.load_args(name))
        self._paths[id(model)] = path
        return model

    def runner(self, name: str, model, num_slots: int, capacity: int, paging=None, shift: int = 0) -> ModelRunner:
        if not self._sharded(name):
            return ModelRunner(model.to(self.device), num_slots, capacity, paging, shift)
        # Followers load the checkpoint themselves; an in-memory model (tests) travels whole.
        source = self._paths.get(id(model)) or _on_cpu(model)
        args = {"num_slots": num_slots, "capacity": capacity, "paging": paging, "shift": shift}
        self.mirror.build(name, source, self.load_args(name), args)
        runner = sharded_runner(model, self.groups, self.device, **args)
        built(self.groups)
        return self.mirror.install(runner, name)

    def stop(self) -> None:
        """Followers leave their loop (their process or thread ends)."""
        self.mirror.stop()

    def _sharded(self, name: str) -> bool:
        return name == "target" or (name == "draft" and self.draft_sharded)


@dataclass(frozen=True)
class _SavedModel:
    """An in-memory model as it travels to the followers: ``torch.save``'s bytes (plain pickle
    cannot carry FP8 tensors' storages)."""

    data: bytes

    def load(self):
        return torch.load(io.BytesIO(self.data), weights_only=False)


def _on_cpu(model) -> _SavedModel:
    param = next(model.parameters())
    buf = io.BytesIO()
    torch.save(model if param.device.type == "cpu" else copy.deepcopy(model).to("cpu"), buf)
    return _SavedModel(buf.getvalue())
