"""Online learning on Ray: a learner hub (the bounded trace buffer and the drafter versions) and
a trainer, each an actor; and the same loop in one process (``OnlineLearner``).

    engine workers --traces--> LearnerHub (buffer, versions) <--rounds-- Trainer (its own bundle)
    engine workers <--the serving version of each method-- LearnerHub

Engine workers ship finished traces and pull the serving versions in the background, never
in a step (``actors/engine_worker.py``). The hub is named per target model (like suffix
decoding's tree actor), so every replica of a deployment, and one that joins later, finds it
and converges to its versions. The hub reserves no CPU and never trains; the trainer actor
runs in a placement-group bundle of its own (``OnlineLearningConfig.trainer_resources``, e.g. a
GPU of its own) and finds the training code by its module name (``trainer``: training sits
beside the serving stack and is not imported by it). Without ``trainer_resources`` the trainer
takes what the cluster has free when learning starts — up to one CPU, or a share of the cores
the server uses when nothing is free (``auto_trainer_resources``) — so it runs on any machine
that can serve. A bundle that cannot be placed is never a silent wait: the engines report it to
the hub, whose status names what the trainer waits for and what the cluster has free.

Faults never reach serving: a dead or killed trainer stops only learning (the hub says so in
its status: ``trainer: lost``; Ray restarts it); a dead hub loses its buffer and the engines
keep their serving versions, start a new hub at their next exchange and register with it again.
Nothing captured leaves the cluster: traces live in the hub's memory only.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import time
from types import SimpleNamespace
from pydantic import BaseModel, ConfigDict, Field

from specray.engine.capture import MAX_TOP_K, CaptureConfig, Trace, TraceBuffer
from specray.engine.drafter_versions import Blueprint, DrafterVersion, base_version, write_version

log = logging.getLogger(__name__)

NAMESPACE = "specray"


class OnlineLearningConfig(BaseModel):
    """``online_learning:`` — drafters that learn from what they serve (``--online-learning``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Capture traffic, train and swap drafter versions (also needed to load "
                                             "drafter versions through the API).")
    learn: bool = Field(True, description="Train from captured traffic (false: versions change only by explicit loads). "
                                          "Switchable at run time.")
    methods: list[str] | None = Field(None, description="Drafters that learn (default: every loaded one that can).")
    sample_rate: float = Field(1.0, ge=0, le=1, description="Share of those methods' requests captured.")
    top_k: int = Field(20, ge=1, le=MAX_TOP_K, description="Teacher log-probabilities kept per verified position "
                                                           "(draft model).")
    min_tokens: int = Field(8, ge=1, description="Requests with fewer generated tokens are not captured.")
    buffer_mb: float = Field(64.0, gt=0, description="The trace buffer's cap (oldest traces out).")
    round_requests: int = Field(32, ge=2, description="New traces of a method that start a training round.")
    steps: int = Field(100, ge=1, description="Optimiser steps per round (the method's recipe).")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate per round.")
    batch_size: int = Field(16, ge=1, description="Sequences (draft model) or windows (heads) per step.")
    greedy_temperature: float = Field(0.25, ge=0, description="The teacher's temperature for greedy requests "
                                                              "(draft model, EAGLE-3; sampled ones: their own).")
    holdout: float = Field(0.25, gt=0, lt=1, description="Share of the newest traces held out for the gate.")
    min_gain: float = Field(0.01, ge=0, description="Relative gain in mean accepted length a candidate needs.")
    gate_options: dict[str, dict] = Field(default_factory=dict, description="Per method: the request options the "
                                                                            "gate drafts with (default: the method's).")
    sync_interval_s: float = Field(1.0, gt=0, description="How often engine workers exchange with the hub.")
    trainer: str = Field("specray.training.online", description="Module whose train_round(...) trains and gates.")
    trainer_resources: dict[str, float] | None = Field(
        None, description="Ray resources of the trainer actor (num_cpus, num_gpus, custom). Default: what the "
                          "cluster has free when learning starts, up to 1 CPU; with nothing free, no reservation "
                          "(it shares the server's cores).")
    name: str | None = Field(None, description="The hub's actor name (default: from the target model).")

    def capture(self) -> CaptureConfig:
        return CaptureConfig(tuple(self.methods) if self.methods is not None else None, self.sample_rate,
                             self.top_k, self.min_tokens)

    def round_config(self, method: str) -> dict:
        return {"steps": self.steps, "lr": self.lr, "batch_size": self.batch_size, "holdout": self.holdout,
                "min_gain": self.min_gain, "greedy_temperature": self.greedy_temperature,
                "gate_options": dict(self.gate_options.get(method, {}))}


def hub_name(model: str) -> str:
    return "specray-learner-" + hashlib.sha256(model.encode()).hexdigest()[:12]


class VersionStore:
    """Each method's versions: the base (what the engines started with) and every published one;
    the serving version is the newest good one unless one is pinned. A rolled-back version is
    never served again."""

    def __init__(self):
        self._versions: dict[str, list[DrafterVersion]] = {}
        self._bad: set[str] = set()
        self._pinned: dict[str, str] = {}
        self._count: dict[str, int] = {}

    def register_base(self, method: str, state: dict) -> None:
        if method not in self._versions:
            self._versions[method] = [DrafterVersion(method, base_version(method), state, {"source": "base"})]

    def has(self, method: str) -> bool:
        return method in self._versions

    def add(self, v: DrafterVersion, name: str | None = None) -> DrafterVersion:
        self._count[v.method] = self._count.get(v.method, 0) + 1
        v.version = name or v.version or f"{v.method}@{self._count[v.method]}"
        if any(x.version == v.version for x in self._versions.get(v.method, ())):
            v.version = f"{v.version}.{self._count[v.method]}"
        self._versions.setdefault(v.method, []).append(v)
        return v

    def next_name(self, method: str) -> str:
        return f"{method}@{self._count.get(method, 0) + 1}"

    def find(self, method: str, version: str) -> DrafterVersion:
        for v in self._versions.get(method, ()):
            if v.version == version:
                return v
        raise ValueError(f"{method}: no version {version!r} (known: {[v.version for v in self._versions.get(method, ())]})")

    def serving(self, method: str) -> DrafterVersion | None:
        if method in self._pinned:
            return self.find(method, self._pinned[method])
        good = [v for v in self._versions.get(method, ()) if v.version not in self._bad]
        return good[-1] if good else None

    def pin(self, method: str, version: str | None) -> None:
        if version is None:
            self._pinned.pop(method, None)
        else:
            self.find(method, version)
            self._pinned[method] = version

    def rollback(self, method: str) -> str:
        """Retire the serving version (never served again); the one before it serves."""
        current = self.serving(method)
        if current is None or current.version == base_version(method):
            raise ValueError(f"{method}: nothing to roll back (the base version serves)")
        self._bad.add(current.version)
        self._pinned.pop(method, None)
        return self.serving(method).version

    def listing(self) -> dict:
        return {m: [{**v.describe(), "rolled_back": v.version in self._bad} for v in vs]
                for m, vs in self._versions.items()}


class LearnerCore:
    """The hub's state as a plain class: the trace buffer, the blueprints the trainer builds
    drafters from, the versions, the learning switch and what it did (``status``)."""

    def __init__(self, config: OnlineLearningConfig | dict):
        self.config = OnlineLearningConfig.model_validate(config)
        self.buffer = TraceBuffer(int(self.config.buffer_mb * 2**20))
        self.store = VersionStore()
        self.blueprints: dict[str, Blueprint] = {}
        self.learning = self.config.learn
        self.fresh: dict[str, int] = {}  # method -> traces since its last round
        self.rounds: list[dict] = []
        self.served: list[dict] = []  # finished requests' (time, method, version, accepted length)
        self.captured = 0  # traces received, in all: rounds are placed against it
        self.trainer: dict = {"state": "idle", "seen": None, "error": None}
        self.placement: dict | None = None  # where the trainer runs, or what it waits for (note_placement)

    # -- engines ---------------------------------------------------------------------------
    def wants_blueprint(self, method: str) -> bool:
        return method not in self.blueprints

    def register(self, bp: Blueprint) -> None:
        if bp.method not in self.blueprints:
            self.blueprints[bp.method] = bp
            from specray.engine.drafter_versions import weights_module

            self.store.register_base(bp.method, {k: v.clone() for k, v in weights_module(bp.module).state_dict().items()})

    def push(self, traces: list[Trace], served: list[dict] | None = None) -> dict:
        self.buffer.add(traces)
        self.captured += len(traces)
        for t in traces:
            self.fresh[t.method] = self.fresh.get(t.method, 0) + 1
        served = [{"time": t.finished_at, "method": t.method, "version": t.version,
                   "accepted_length": round(t.accepted_length, 3)} for t in traces] + list(served or [])
        self.served = (self.served + sorted(served, key=lambda x: x["time"]))[-4096:]
        return self.buffer.stats()

    def serving(self, known: dict[str, str]) -> dict[str, DrafterVersion]:
        """The serving versions that differ from ``known`` (method -> version an engine serves)."""
        out = {}
        for method in self.blueprints:
            v = self.store.serving(method)
            if v is not None and known.get(method) != v.version:
                out[method] = v
        return out

    def publish(self, v: DrafterVersion, name: str | None = None) -> str:
        """A version from outside the trainer (an explicit load): it serves everywhere next."""
        return self.store.add(v, name).version

    # -- the trainer -----------------------------------------------------------------------
    def ready(self) -> list[str]:
        """Methods with enough new traces for a round (none while learning is off)."""
        self.trainer["seen"] = time.time()
        if not self.learning:
            return []
        return [m for m in self.blueprints if self.fresh.get(m, 0) >= self.config.round_requests]

    def take_round(self, method: str):
        """(blueprint, serving version, traces, round config) for a round of ``method``."""
        self.fresh[method] = 0
        self.trainer.update(state=f"training {method}", since=time.time(), since_trace=self.captured)
        return self.blueprints[method], self.store.serving(method), self.buffer.traces(method), \
            self.config.round_config(method)

    def finish_round(self, method: str, report: dict, state: dict | None) -> str | None:
        """The trainer's verdict; a candidate that beat the serving version is published."""
        started = {"started": self.trainer.get("since"), "started_at_trace": self.trainer.get("since_trace")}
        self.trainer.update(state="idle", error=None)
        version = None
        serving = self.store.serving(method)
        if state is not None:
            v = DrafterVersion(method, self.store.next_name(method), state, dict(report.get("candidate", {})),
                               parent=serving.version if serving else None)
            version = self.store.add(v).version
        entry = {**report, **started, "time": time.time(), "finished_at_trace": self.captured, "version": version,
                 "kept": None if version else (serving.version if serving else None)}
        self.rounds = (self.rounds + [entry])[-64:]
        log.info("online learning: %s", round_line(entry))
        return version

    def round_failed(self, method: str, error: str) -> None:
        self.trainer.update(state="idle", error=error)
        self.rounds = (self.rounds + [{"method": method, "published": False, "error": error, "time": time.time(),
                                       "finished_at_trace": self.captured}])[-64:]
        log.warning("online learning: a round of %s failed: %s", method, error)

    def note_placement(self, placement: dict) -> None:
        """Where the trainer runs (``state: placed``) or what it waits for (``pending``): the
        engines check its placement group and say so here, since nothing else would."""
        self.placement = dict(placement)

    # -- operations ------------------------------------------------------------------------
    def set_learning(self, on: bool) -> None:
        self.learning = bool(on)

    def learning_on(self) -> bool:
        return self.learning

    def alive(self) -> None:
        """The trainer's heartbeat (also every ``ready`` call)."""
        self.trainer["seen"] = time.time()

    def pin(self, method: str, version: str | None) -> None:
        self.store.pin(method, version)

    def rollback(self, method: str) -> str:
        return self.store.rollback(method)

    def export(self, method: str, version: str, directory: str) -> str:
        return write_version(self.store.find(method, version), self.blueprints[method].module, directory)

    def status(self, trainer_timeout_s: float = 30.0) -> dict:
        seen = self.trainer.get("seen")
        lost = seen is not None and time.time() - seen > trainer_timeout_s
        if not self.learning:
            learning = "off"
        elif lost:
            learning = "paused: the trainer is not answering (lost or restarting); serving is unaffected"
        else:
            learning = "on"
        trainer = dict(self.trainer)
        if self.placement is not None and self.placement.get("state") == "pending":
            trainer["state"] = "pending: " + self.placement["message"]
        if self.placement is not None:
            trainer["placement"] = dict(self.placement)
        return {"learning": learning, "trainer": trainer, "buffer": self.buffer.stats(), "captured": self.captured,
                "versions": self.store.listing(),
                "serving": {m: (self.store.serving(m).version if self.store.serving(m) else None) for m in self.blueprints},
                "rounds": list(self.rounds), "served": list(self.served[-512:])}


def round_line(r: dict) -> str:
    """One line for a training round: the traffic it trained on, the gate's two measures, the verdict."""
    if r.get("error"):
        return f"a round of {r['method']} failed: {r['error']}"
    serving, candidate = r["serving"]["mean_accepted_length"], r["candidate"]["mean_accepted_length"]
    verdict = f"published {r['version']}" if r.get("version") else f"kept {r.get('kept')}"
    return (f"round of {r['method']} on {r['train_traces']} traces ({r['held_out_traces']} held out, "
            f"{r['seconds']:.0f} s): {verdict} (held-out mean accepted length: candidate {candidate:.3f}, "
            f"serving {serving:.3f})")


def load_trainer(name: str):
    """The training code by name — a module with ``train_round`` (and ``trainable``), or
    ``module:function`` for a ``train_round`` of your own: training is not imported by the stack."""
    module, _, attr = name.partition(":")
    found = importlib.import_module(module)
    if not attr:
        return found
    fn = getattr(found, attr)
    return SimpleNamespace(train_round=fn, trainable=getattr(found, "trainable", lambda method: True))


class OnlineLearner:
    """The whole loop in one process, over an ``LLMEngine`` built with ``online_learning``:
    call ``pump()`` between steps (or requests); it moves finished traces to the buffer, runs a
    training round (synchronously) when a method has enough new ones, and swaps in what the gate
    publishes. The Ray layout runs the same cores in actors instead."""

    def __init__(self, engine, config: OnlineLearningConfig | dict):
        self.engine, self.core = engine, LearnerCore(config)
        self.trainer = load_trainer(self.core.config.trainer)
        for method in engine.capture.methods:
            if self.trainer.trainable(method):
                self.core.register(engine.versions.blueprint(method))

    def pump(self) -> list[dict]:
        """Returns the rounds run (their reports)."""
        self.core.push(self.engine.take_traces())
        reports = []
        for method in self.core.ready():
            bp, serving, traces, cfg = self.core.take_round(method)
            result = self.trainer.train_round(bp, serving, traces, cfg)
            version = self.core.finish_round(method, result.describe(), result.state)
            if version is not None:
                self.engine.use_drafter(self.core.store.serving(method))
            reports.append({**result.describe(), "version": version})
        return reports


# -- Ray ---------------------------------------------------------------------------------------
class TrainerLoop:
    """The trainer actor: asks the hub for methods ready for a round, trains in a thread (the
    actor stays responsive), reports back. Its heartbeat is the hub's ``ready`` call."""

    def __init__(self, hub, config: dict, poll_s: float = 0.5):
        self.hub, self.poll_s = hub, poll_s
        self.config = OnlineLearningConfig.model_validate(config)
        self.trainer = load_trainer(self.config.trainer)
        self._task = None

    async def start(self) -> bool:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return True

    async def _loop(self) -> None:
        while True:
            try:
                for method in await self.hub.ready.remote():
                    bp, serving, traces, cfg = await self.hub.take_round.remote(method)
                    try:
                        result = await self._train(bp, serving, traces, cfg)
                    except Exception as exc:  # noqa: BLE001 - a round that fails is reported, the loop goes on
                        log.exception("training round of %s failed", method)
                        await self.hub.round_failed.remote(method, f"{type(exc).__name__}: {exc}")
                        continue
                    await self.hub.finish_round.remote(method, result.describe(), result.state)
            except Exception:  # noqa: BLE001 - the hub is being replaced: try again later
                log.warning("trainer: the learner hub did not answer; retrying", exc_info=True)
            await asyncio.sleep(self.poll_s)

    async def _train(self, *args):
        """A round in a thread, with a heartbeat to the hub while it runs."""
        job = asyncio.ensure_future(asyncio.to_thread(self.trainer.train_round, *args))
        while not job.done():
            await asyncio.wait([job], timeout=self.poll_s)
            try:
                await self.hub.alive.remote()
            except Exception:  # noqa: BLE001 - reported once the round is done
                pass
        return job.result()


def hub_for(config: OnlineLearningConfig, model: str):
    """The named hub actor for ``model`` (created on first use), and its trainer (one per hub,
    in a placement-group bundle of its own: ``trainer_resources``, e.g. a GPU)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = config.name or hub_name(model)
    hub = ray.remote(LearnerCore).options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                                          num_cpus=0, max_restarts=-1).remote(config.model_dump())
    try:  # a trainer made earlier (by another replica) keeps its placement
        trainer = ray.get_actor(name + "-trainer", namespace=NAMESPACE)
    except ValueError:
        options = trainer_options(config)
        bundle = trainer_bundle(name, options)
        strategy = (PlacementGroupSchedulingStrategy(placement_group=bundle, placement_group_bundle_index=0)
                    if bundle is not None else "DEFAULT")
        trainer = ray.remote(TrainerLoop).options(
            name=name + "-trainer", namespace=NAMESPACE, get_if_exists=True, lifetime="detached", max_restarts=-1,
            max_concurrency=4, scheduling_strategy=strategy, **options).remote(hub, config.model_dump())
    trainer.start.remote()
    return hub, trainer


def trainer_bundle(name: str, options: dict):
    """The trainer's placement group (one bundle, detached: it outlives the replicas), by name;
    None when it reserves nothing (a bundle cannot be empty)."""
    from ray.util import get_placement_group
    from ray.util.placement_group import placement_group

    try:
        return get_placement_group(name + "-trainer")
    except ValueError:
        bundle = {k: v for k, v in {"CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0),
                                    **options.get("resources", {})}.items() if v}
        return placement_group([bundle], name=name + "-trainer", lifetime="detached") if bundle else None


def auto_trainer_resources(free_cpus: float) -> dict[str, float]:
    """The trainer's default reservation: half of the CPUs free now, at most one, so that the
    server keeps room to grow; nothing when (almost) nothing is free — Ray reserves logical
    CPUs only, so the trainer then runs on the cores the server uses, slower, never stuck.

    >>> auto_trainer_resources(6.0), auto_trainer_resources(0.5), auto_trainer_resources(0.0)
    ({'num_cpus': 1.0}, {'num_cpus': 0.25}, {'num_cpus': 0.0})
    """
    share = min(1.0, free_cpus / 2)
    return {"num_cpus": round(share, 2) if share >= 0.01 else 0.0}


def trainer_options(config: OnlineLearningConfig) -> dict:
    """The trainer actor's resource options: ``trainer_resources`` or the default from what is free."""
    import ray

    res = dict(config.trainer_resources if config.trainer_resources is not None
               else auto_trainer_resources(ray.available_resources().get("CPU", 0.0)))
    out = {"num_cpus": res.pop("num_cpus", 1.0)}
    if "num_gpus" in res:
        out["num_gpus"] = res.pop("num_gpus")
    if res:
        out["resources"] = res
    return out


def trainer_placement(config: OnlineLearningConfig, model: str) -> dict:
    """Where the trainer runs, or what it waits for: ``{"state": "placed" | "pending", "resources":
    the bundle, "message": one line}``."""
    import ray
    from ray.util import get_placement_group

    name = config.name or hub_name(model)
    try:
        group = get_placement_group(name + "-trainer")
    except ValueError:
        return {"state": "placed", "resources": {},
                "message": "no reservation: the trainer shares the cores the server uses"}
    bundle = {k: v for k, v in group.bundle_specs[0].items() if not k.startswith(("bundle", "node"))}
    wanted = ", ".join(f"{k} {v:g}" for k, v in sorted(bundle.items()))
    if ray.util.placement_group_table(group).get("state") == "CREATED":
        return {"state": "placed", "resources": bundle, "message": f"the trainer holds {wanted}"}
    free, total = ray.available_resources(), ray.cluster_resources()
    has = ", ".join(f"{k} {free.get(k, 0.0):g} of {total.get(k, 0.0):g}" for k in sorted(bundle))
    return {"state": "pending", "resources": bundle,
            "message": f"the trainer waits for {wanted} (free now: {has}); lower online_learning.trainer_resources "
                       f"or add resources"}


def drop_learner(config: OnlineLearningConfig, model: str) -> None:
    """Kill the hub and its trainer (tests, operations)."""
    import ray

    from ray.util import get_placement_group, remove_placement_group

    name = config.name or hub_name(model)
    for actor in (name + "-trainer", name):
        try:
            ray.kill(ray.get_actor(actor, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass
    try:
        remove_placement_group(get_placement_group(name + "-trainer"))
    except ValueError:
        pass


class OnlineSync:
    """An engine worker's side of the exchange, in a background task (never inside a step):
    every ``sync_interval_s`` it ships finished traces to the hub, registers the drafters'
    blueprints the hub lacks, follows the learning switch, and swaps in the serving versions
    the hub names (between steps: under the worker's step lock). A hub that does not answer is
    looked up (or started) again at the next exchange; serving never waits for it."""

    def __init__(self, engine, config: OnlineLearningConfig | dict, model: str, lock: asyncio.Lock):
        self.engine, self.lock = engine, lock
        self.config = OnlineLearningConfig.model_validate(config)
        self.model = model
        self.hub = self.trainer = None
        self.state = "starting"
        self.dropped = 0
        self.placed = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.exchange()
            await asyncio.sleep(self.config.sync_interval_s)

    async def exchange(self) -> None:
        traces = self.engine.take_traces()
        try:
            if self.hub is None:
                self.hub, self.trainer = hub_for(self.config, self.model)
            if traces:
                await self.hub.push.remote(traces)
            for method in self.engine.versions.methods:
                if method in self.engine.capture.methods and await self.hub.wants_blueprint.remote(method):
                    await self.hub.register.remote(self.engine.versions.blueprint(method))
            self.engine.capture.enabled = await self.hub.learning_on.remote()
            new = await self.hub.serving.remote(dict(self.engine.versions.serving))
            if new:
                async with self.lock:
                    for v in new.values():
                        self.engine.use_drafter(v)
            self.trainer.start.remote()  # idempotent; restarts the loop of a trainer Ray restarted
            if not self.placed:
                placement = trainer_placement(self.config, self.model)
                await self.hub.note_placement.remote(placement)
                if placement["state"] == "pending" and self.state != "waiting":
                    log.warning("online learning: %s", placement["message"])
                self.placed = placement["state"] == "placed"
            self.state = "ok" if self.placed else "waiting"
        except Exception as exc:  # noqa: BLE001 - learning pauses; serving goes on
            self.dropped += len(traces)
            self.state = f"learner hub unreachable ({type(exc).__name__}); retrying"
            log.warning("online learning: %s", self.state)
            self.hub = self.trainer = None

    async def publish(self, v: DrafterVersion) -> str:
        """An explicitly loaded version: the hub serves it to every replica."""
        if self.hub is None:
            self.hub, self.trainer = hub_for(self.config, self.model)
        return await self.hub.publish.remote(v, v.version)
