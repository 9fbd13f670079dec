"""The single-process speculative engine with continuous batching.

    engine = LLMEngine(EngineConfig(target=DIR, draft=DIR))
    engine.add_request("def fib(n):", SamplingParams(max_tokens=32, temperature=0),
                       SpeculationParams(method="draft", num_speculative_tokens=4))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each ``step`` runs the step driver (``engine/driver.py``): admit waiting requests (a
batched prefill that samples their first token), then one speculative step over the
running batch: propose -> verify -> accept -> commit. Requests join and leave between
steps; a row's tokens never depend on the other rows. The Ray engine worker runs the same
driver with the same executor, some of its proposers being proxies to other actors.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Mapping, Sequence

from specray.engine.config import EngineConfig, load_tokenizer
from specray.engine.capture import Capture
from specray.engine.delta import StepDelta
from specray.engine.device_step import greedy_pass
from specray.engine.drafter_versions import DrafterVersion, DrafterVersions, read_version
from specray.engine.driver import StepDriver, run_sync
from specray.engine.executor import LocalExecutor, ProposerTable
from specray.engine.graphs import COMPILED
from specray.engine.intake import RequestMaker
from specray.engine.kv_blocks import proposer_paging
from specray.engine.memory import kv_bytes_per_token
from specray.engine.params import SamplingParams
from specray.engine.request import Request, RequestOutput
from specray.engine.runner import ModelRunner
from specray.engine.scheduler import Scheduler
from specray.engine.profile import profile_costs
from specray.engine.warmup import warm_up
from specray.policies.checkpoint_files import measured_acceptance
from specray.policies.budget import BudgetConfig, VerificationBudget
from specray.policies.registry import Limits, MethodOptions, ProposerContext, method_spec, registered_methods

log = logging.getLogger(__name__)


class LLMEngine:
    """Target model + proposers + request queue. Not thread-safe; actors wrap it.

    In-memory models (tests, embedding) may be passed instead of checkpoints:
    ``target_model``, ``draft_model``, ``medusa_heads``, or any method's loaded resource in
    ``resources`` (method name -> what its spec's ``load`` returns). ``proposers`` maps
    methods served elsewhere (Ray proxies to workers of their own) to a factory called with
    this engine's ``ProposerContext``; ``proposer_facts`` are their validation facts.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        target_model=None,
        draft_model=None,
        tokenizer=None,
        medusa_heads=None,
        resources: Mapping[str, object] | None = None,
        proposers: Mapping[str, object] | None = None,
        proposer_facts: Mapping[str, dict] | None = None,
        runners=None,
    ):
        self.config = config = config or EngineConfig()
        if config.tensor_parallel_size > 1 and runners is None:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs a group of ranks: serve it "
                             "through the Ray actors (specray serve / generate start them), not the in-process engine")
        # Where the models load and which runner holds each: here, whole (default), or split over
        # a tensor-parallel group whose rank 0 this engine is (engine/mirror.py: ShardedRunners).
        self.runners = runners or LocalRunners(config)
        if target_model is None:  # from checkpoints (in-memory models are for tests/embedding)
            target_model = self.runners.load("target", config.require_target())
            if tokenizer is None:
                tokenizer = load_tokenizer(config.tokenizer or config.target)
        self.tokenizer = tokenizer
        context_len = config.context_length(target_model.config)
        compute = next(p for p in target_model.parameters() if p.element_size() > 1).dtype  # FP8 weights aside
        # Per rank: a split target's rank holds its share of the KV heads (a pool of blocks per rank).
        per_token = kv_bytes_per_token(target_model.config, str(compute).removeprefix("torch."),
                                       config.tensor_parallel_size)
        self.paging = config.paging(context_len, per_token)
        self.target = self.runners.runner("target", target_model, config.max_num_seqs, context_len, self.paging)
        # A sequence can hold at most what the target's KV pool holds (paged: a pool smaller
        # than one context caps it; a prompt that cannot fit is refused at admission).
        self.capacity = min(context_len, self.paging.num_blocks * self.paging.block_size) if self.paging else context_len
        if self.paging is not None:
            log.info("KV cache: %d blocks of %d tokens (%d tokens; %s); prefix caching %s", self.paging.num_blocks,
                     self.paging.block_size, self.paging.num_blocks * self.paging.block_size,
                     f"sequences capped at {self.capacity} tokens" if self.capacity < context_len else "paged",
                     "on" if self.paging.prefix_caching else "off")
        self.step_mode = config.step_mode(self.target.device)
        context = ProposerContext(
            vocab_size=self.target.vocab_size, max_num_seqs=config.max_num_seqs, capacity=self.capacity,
            device=str(self.target.device), dtype=config.resolved_dtype, target=self.target, runner_for=self._runner_for,
            step=self.step_mode,
        )
        given = dict(resources or {})
        if draft_model is not None:
            given["draft"] = self._draft_runner(draft_model)
        if medusa_heads is not None:
            given["medusa"] = medusa_heads
        proposers = dict(proposers or {})
        self.resources = load_resources(config, context, given, skip=set(proposers))
        facts = {m: {} for m in proposers} | dict(proposer_facts or {})
        self.limits = Limits(
            capacity=self.capacity,
            vocab_size=self.target.vocab_size,
            eos_ids=eos_ids(target_model, tokenizer),
            methods=available_methods(self.resources, facts),
        )
        self.proposers = ProposerTable(context, self.resources, {m: make(context) for m, make in proposers.items()})
        if self.step_mode != "eager":
            # The fixed-shape forward hands over the layer taps every loaded method reads.
            # Acceptance runs inside the target's graph (its epilogue): one compiled call a step.
            self.target.enable_static(self.step_mode, layers=self.proposers.all_feature_layers(), epilogue=greedy_pass)
            for resource in self.resources.values():
                if isinstance(resource, ModelRunner):  # draft models (draft, PARD) draft with fixed shapes too
                    resource.enable_static(self.step_mode)
        log.info("step mode: %s", self.step_mode)
        self.intake = RequestMaker(self.limits, tokenizer, config.default_speculation)
        self.scheduler = Scheduler(config.max_num_seqs)
        self.executor = LocalExecutor(self.target, self.proposers)
        # How many nodes each row drafts: static caps when configured, else the verification
        # budget, its estimates starting from the acceptance the loaded weights were measured at.
        length = config.speculation_length or VerificationBudget(
            BudgetConfig(), measured_priors(config, self.limits.methods))
        # A step's cost: on a CPU with every proposer in this process, the CPU seconds it
        # takes (which other work on the same cores does not inflate, as it does wall time);
        # wall seconds where a device or another process works for it.
        cpu_bound = self.target.device.type == "cpu" and not proposers
        self.driver = StepDriver(self.scheduler, self.executor, self.capacity, tokenizer, length,
                                 clock=cpu_clock() if cpu_bound else time.perf_counter,
                                 grammar_drafter=config.grammar_drafter)
        self.capture = self.versions = None
        if config.online_learning is not None:  # online learning: capture, versioned drafters
            self.versions = DrafterVersions(self.proposers, list(self.limits.methods), self.driver.length_policy)
            self.versions.checkpoint_of = lambda m: config.checkpoint(method_spec(m).checkpoint or "")
            self.capture = Capture(config.online_learning, self.versions.methods)
            self.capture.versions = self.versions.serving
            self.executor.taps += [self.versions, self.capture]
            self.executor.rebuilds_heads = True
        self._text_sent: dict[str, int] = {}  # request id -> characters of its text in deltas so far
        self.warmup_seconds = None  # what compiling the step took at start-up (compiled steps)
        if self.step_mode in COMPILED and config.warm_up and not proposers:  # remote proposers warm up there
            self.warmup_seconds = warm_up(self)
        self.profile_seconds = None  # what measuring the budget's cost table took at start-up
        # (compiled steps compile a graph per shape: there the table fills from served steps)
        if isinstance(length, VerificationBudget) and config.profile_costs and not proposers \
                and self.step_mode not in COMPILED:
            self.profile_seconds = profile_costs(self, length)

    def _runner_for(self, model, extra_capacity: int = 0, shift: int = 0, name: str = "draft") -> ModelRunner:
        """A runner for a proposer's model (a draft model, an EAGLE head): its cache paged like
        the target's, its pool large enough that it never runs out before the target's does. A
        head runs here, beside rank 0's features; a draft model by path: ``_draft_runner``
        (``name``: which, ``draft`` or ``pard``; only ``draft`` is split at draft TP N)."""
        if isinstance(model, str):  # a causal-LM checkpoint by path: a draft model
            return self._draft_runner(self.runners.load(name, model), name)
        return ModelRunner(model, self.config.max_num_seqs, self.capacity + extra_capacity,
                           proposer_paging(self.paging, self.config.max_num_seqs, extra_capacity), shift)

    def _draft_runner(self, model, name: str = "draft") -> ModelRunner:
        """The draft model's runner: whole here, or split with the target at
        draft_tensor_parallel_size N (``self.runners``)."""
        return self.runners.runner(name, model, self.config.max_num_seqs, self.capacity,
                                   proposer_paging(self.paging, self.config.max_num_seqs, 0))

    @property
    def medusa_heads(self):
        return self.resources.get("medusa")

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        speculation: MethodOptions | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        return self.add(self.intake.make(prompt, sampling, speculation, request_id))

    def add(self, request: Request) -> str:
        """Queue a request already made (validated and tokenised where it entered); returns its id.
        A request resumed from another worker has had its text so far sent already."""
        if request.text:
            self._text_sent[request.request_id] = len(request.text)
        if request.grammar_source is not None and request.grammar is None:
            request.grammar = self.intake.grammars.matcher(request.grammar_source, request.stop_ids, request.output_ids)
        return self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its last output (finish_reason 'abort') if it existed."""
        self._text_sent.pop(request_id, None)
        return self.scheduler.abort(request_id, self.driver.release)

    def fail(self, request_id: str, message: str) -> StepDelta | None:
        """Finish a request now with 'error' and ``message``, freeing its slot; returns its last
        step delta (finish reason 'error') if it existed."""
        sent = self._text_sent.pop(request_id, 0)
        out = self.scheduler.abort(request_id, self.driver.release, error=message)
        return None if out is None else StepDelta.of(out, sent)

    def request_ids(self) -> list[str]:
        """The requests queued or running, running first."""
        return self.scheduler.request_ids()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, the target's and each drafter's, as vLLM's
        ``LLM.reset_prefix_cache`` does: the next requests prefill in full, as on a fresh engine
        (a benchmark that runs the same prompts through several configurations). False, and
        nothing dropped, while requests are in the engine."""
        if self.has_unfinished():
            return False
        self.target.forget_prefixes()
        self.proposers.forget_prefixes()
        return True

    def progress(self, request_ids: Iterable[str]) -> dict[str, dict]:
        """What continuing each of ``request_ids`` still here on another worker needs besides its
        tokens: its ``metrics`` so far and, when it samples with a seed, its ``generator`` state."""
        out = {}
        for rid in request_ids:
            req = self.scheduler.find(rid)
            if req is None:
                continue
            seeded = req.generator is not None and not req.sampling.greedy
            out[rid] = {"metrics": req.metrics.to_dict(), "generator": req.generator.get_state() if seeded else None}
        return out

    @property
    def totals(self):
        """Metrics summed over finished requests."""
        return self.scheduler.totals

    def stats(self, reset: bool = False) -> dict:
        """``phases``: seconds the steps waited for drafts (``propose``) and verified
        (``verify``), and their count (``steps``), since the last reset; ``reset`` starts them
        over. ``totals``: metrics summed over finished requests; ``waiting``, ``running``."""
        phases = dict(self.driver.phase_seconds)
        if reset:
            self.driver.phase_seconds = {"propose": 0.0, "verify": 0.0, "steps": 0}
        return {"phases": phases, "totals": self.totals.to_dict(), "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running), "kv": self.executor.kv_stats(),
                "preemptions": self.scheduler.preemptions}

    def speculation(self) -> dict:
        """The speculation-length policy's state: the verification budget's cost table,
        calibrations, last decision and totals (``VerificationBudget.status``), or the
        static caps' settings."""
        policy = self.driver.length_policy
        if isinstance(policy, VerificationBudget):
            return {"policy": "budget", "profile_s": self.profile_seconds, **policy.status()}
        return {"policy": "static", "disable_above_batch": policy.disable_above_batch,
                "batch_k_caps": [list(c) for c in policy.batch_k_caps]}

    def describe(self) -> dict:
        """Which driver, executor and proposer classes this engine runs (tests, operations)."""
        name = lambda obj: f"{type(obj).__module__}.{type(obj).__qualname__}"  # noqa: E731
        proposers = {m: name(self.proposers.get(m)) for m in self.limits.methods if self.proposers.get(m) is not None}
        return {"driver": name(self.driver), "executor": name(self.executor), "proposers": proposers}

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, then one speculative step; outputs of rows that moved."""
        self._stamp()
        return run_sync(self.driver.step())

    def _stamp(self) -> None:
        if self.versions is not None:
            self.versions.stamp([*self.scheduler.running.values(), *self.scheduler.waiting])

    # -- drafter versions (online learning) ----------------------------------------------
    def load_drafter(self, method: str, directory: str, version: str | None = None) -> str:
        """Serve ``method``'s weights from ``directory`` (its public layout) from the next step
        on, swapped in place and rebuilt for running requests (``engine/drafter_versions.py``);
        returns the version's name. Needs ``EngineConfig.online_learning``."""
        self.use_drafter(read_version(method, directory, self.proposers.context, version))
        return self.versions.serving[method]

    def use_drafter(self, v: DrafterVersion) -> None:
        """Serve version ``v`` from the next step on (call between steps)."""
        if self.versions is None:
            raise ValueError("drafter versions need online_learning in the engine config (--online-learning)")
        self.versions.swap(v)

    def take_traces(self) -> list:
        """Captured traces of finished requests not taken yet (``engine/capture.py``)."""
        return self.capture.take() if self.capture is not None else []

    async def step_deltas(self) -> list[StepDelta]:
        """The same step inside an event loop (where proposers may be remote), as deltas:
        per request that moved, only what this step added (``engine/delta.py``)."""
        deltas = []
        self._stamp()
        for out in await self.driver.step():
            deltas.append(StepDelta.of(out, self._text_sent.pop(out.request_id, 0)))
            if not out.finished:
                self._text_sent[out.request_id] = len(out.text)
        return deltas

    # -- convenience -------------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        speculation: MethodOptions | Sequence[MethodOptions] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        prompts = list(prompts)
        samplings = _per_prompt(sampling, len(prompts))
        speculations = _per_prompt(speculation, len(prompts))
        ids = [self.add_request(p, s, sp) for p, s, sp in zip(prompts, samplings, speculations)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


class LocalRunners:
    """Every model whole in this process, on the config's device (the default runner factory)."""

    def __init__(self, config: EngineConfig):
        self.config = config

    def load(self, name: str, path: str):
        return self.config.load_model(path, role=name)

    def runner(self, name: str, model, num_slots: int, capacity: int, paging=None, shift: int = 0) -> ModelRunner:
        return ModelRunner(model, num_slots, capacity, paging, shift)


def load_resources(config: EngineConfig, context: ProposerContext, given: Mapping[str, object],
                   skip: set[str] = frozenset()) -> dict[str, object]:
    """Each method's loaded checkpoint (``spec.load``), for the checkpoints configured here;
    ``given`` (in-memory) ones win, ``skip`` (served elsewhere) are not loaded."""
    resources = dict(given)
    for name in registered_methods():
        spec = method_spec(name)
        path = config.checkpoint(spec.checkpoint) if spec.checkpoint else None
        if path and name not in resources and name not in skip:
            resources[name] = spec.load(path, context)
    return resources


def measured_priors(config: EngineConfig, methods) -> dict[str, list[float]]:
    """Method -> the acceptance its weights' directory says was measured (``specray_acceptance``:
    saved by training, and for the demo pair's draft), for the methods available here."""
    priors = {}
    for name in methods:
        key = method_spec(name).checkpoint
        rates = measured_acceptance(config.checkpoint(key)) if key else None
        if rates:
            priors[name] = rates
    return priors


def available_methods(resources: Mapping[str, object], remote_facts: Mapping[str, dict] | None = None) -> dict:
    """Validation facts of every method this engine can run (``Limits.methods``)."""
    facts = {}
    for name in registered_methods():
        spec = method_spec(name)
        if remote_facts and name in remote_facts:
            facts[name] = dict(remote_facts[name])
        elif spec.checkpoint is None:
            facts[name] = {}
        elif name in resources:
            facts[name] = spec.facts(resources[name]) if spec.facts else {}
    return facts


def cpu_clock():
    """The CPU seconds a step costs: the thread's where torch computes in it alone (one
    intra-op thread, as on shared CPU machines), else the process's. ``process_time`` sums
    every thread's time in the kernel, which cost up to milliseconds per call here (a
    compiled step's whole host budget); ``thread_time`` reads one."""
    import torch

    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


def _per_prompt(value, n: int) -> list:
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} parameter sets for {n} prompts")
    return list(value)


def eos_ids(model, tokenizer) -> frozenset[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
