"""Placement by role: which model runs on which GPU and node, failing fast when infeasible.

The seeds place models by device lists (TensorRT-LLM: ``target_model_device_list=[2,3]``,
``draft_model_device_list=[1]``); specray places them by Ray bundles, one per device:

    target  ``tensor_parallel_size`` bundles, one per rank, in a placement group of their own
            with STRICT_PACK when there are several (a TP group's all-reduces stay on one
            node's links); one bundle otherwise
    draft   its own bundle (a draft model at TP 1 in an actor of its own)
    engine  the colocated layout: the target's bundles, the draft inside rank 0

The roles beside a TP group (the draft) share a placement group with the configured strategy
(``PACK``, ``SPREAD``, ...); without TP every role is in that one group, as before. Users who
pin GPUs set ``CUDA_VISIBLE_DEVICES`` for Ray; specray asks Ray for amounts, never indices.

``reserve`` checks the cluster before it waits: the total of each resource, and for a TP group
a node with its whole share; a layout that cannot be hosted is a ``PlacementError`` naming the
resource, how much is needed and how much there is.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

TP_STRATEGY = "STRICT_PACK"


class ModelPlacement(BaseModel):
    """Resources of one model's worker (one placement-group bundle per rank)."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float | None = Field(
        None, ge=0, description="GPUs for this model's worker, per tensor-parallel rank; None = 1 if the cluster "
        "has GPUs, else 0."
    )
    num_cpus: float = Field(
        0.5, gt=0, description="CPUs reserved for the worker (a scheduling share: workers run one torch "
        "thread each), small enough that target, draft and n-gram pool fit a 2-core laptop."
    )


class PlacementConfig(BaseModel):
    """Where each model runs (cf. TensorRT-LLM's draft/target_model_device_list).

    separate: target and draft in actors of their own, each bundle on its own GPU(s);
    colocated: one actor holds both (no hop per step).
    """

    model_config = ConfigDict(extra="forbid")

    mode: Literal["separate", "colocated"] = Field("separate", description="separate actors or one actor")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the bundles (SPREAD: different nodes); a "
        "tensor-parallel target's ranks are always STRICT_PACK (one node), the other roles use this.")
    target: ModelPlacement = Field(default_factory=ModelPlacement)
    draft: ModelPlacement = Field(default_factory=ModelPlacement)
    ngram_cpus: float = Field(0.25, gt=0, description="CPUs reserved for the n-gram pool actor.")
    timeout_s: float = Field(30.0, gt=0, description="How long to wait for the placement group.")


class PlacementError(RuntimeError):
    """The cluster cannot host the requested placement."""


@dataclass(frozen=True)
class Layout:
    """Each role's bundles (one per rank) and which of them form a tensor-parallel group."""

    roles: dict[str, list[dict]]
    tp_role: str | None = None  # the role whose ranks are STRICT_PACK in a group of their own

    def describe(self) -> str:
        return ", ".join(f"{r}: {len(b)} x {b[0]}" if len(b) > 1 else f"{r}: {b[0]}" for r, b in self.roles.items())


def layout_for(config: PlacementConfig, with_draft: bool, tensor_parallel_size: int = 1,
               cluster_gpus: float = 0.0) -> Layout:
    """The bundles of each role: target (x ranks) + draft, or the colocated engine (x ranks)."""

    def bundle(spec: ModelPlacement) -> dict:
        gpus = spec.num_gpus if spec.num_gpus is not None else (1.0 if cluster_gpus >= 1 else 0.0)
        return {k: v for k, v in {"CPU": spec.num_cpus, "GPU": gpus}.items() if v > 0}

    ranks = [bundle(config.target) for _ in range(tensor_parallel_size)]
    tp_role = None
    if config.mode == "colocated":
        roles = {"engine": ranks}
        tp_role = "engine" if tensor_parallel_size > 1 else None
    else:
        roles = {"target": ranks}
        tp_role = "target" if tensor_parallel_size > 1 else None
        if with_draft:
            roles["draft"] = [bundle(config.draft)]
    return Layout(roles, tp_role)


@dataclass
class Placement:
    """Ready placement groups and the scheduling options of each role's actors."""

    layout: Layout
    groups: dict[str, object]  # role -> its placement group
    index: dict[str, list[int]] = field(default_factory=dict)  # role -> bundle index of each rank

    @property
    def roles(self) -> list[str]:
        return list(self.layout.roles)

    def options(self, role: str, rank: int = 0) -> dict:
        """Actor options: the bundle of ``role``'s rank, and exactly its resources."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.layout.roles[role][rank]
        return {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[role], placement_group_bundle_index=self.index[role][rank]
            ),
        }

    def rank_options(self, role: str) -> list[dict]:
        """Options of ranks 1.. of ``role`` (its tensor-parallel followers); [] without TP."""
        return [self.options(role, r) for r in range(1, len(self.layout.roles[role]))]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in {id(g): g for g in self.groups.values()}.values():
            remove_placement_group(group)


def check_feasible(layout: Layout, nodes: list[dict], tensor_parallel_size: int) -> None:
    """PlacementError unless the cluster's totals (and for a TP group, one node) can host the
    layout; ``nodes`` are the alive nodes' resources (``ray.nodes()``' ``Resources``)."""
    bundles = [b for bs in layout.roles.values() for b in bs]
    for resource in ("GPU", "CPU"):
        need = sum(b.get(resource, 0) for b in bundles)
        have = sum(n.get(resource, 0) for n in nodes)
        if need > have:
            hint = (f"; placement mode colocated holds the draft on the target's device"
                    if "draft" in layout.roles and resource == "GPU" else "")
            raise PlacementError(f"placement needs {need:g} {resource} ({layout.describe()}) but the cluster has "
                                 f"{have:g}{hint}")
    if layout.tp_role is None:
        return
    ranks = layout.roles[layout.tp_role]
    for resource in ("GPU", "CPU"):
        need = sum(b.get(resource, 0) for b in ranks)
        most = max((n.get(resource, 0) for n in nodes), default=0)
        if need > most:
            raise PlacementError(
                f"tensor_parallel_size {tensor_parallel_size} needs {need:g} {resource} on one node (the "
                f"{layout.tp_role}'s {len(ranks)} ranks are {TP_STRATEGY}: {ranks[0]} each) but the largest node "
                f"has {most:g}")


async def reserve(config: PlacementConfig, with_draft: bool, tensor_parallel_size: int = 1) -> Placement:
    """Create and wait for the placement groups, or raise PlacementError quickly."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    layout = layout_for(config, with_draft, tensor_parallel_size, total.get("GPU", 0))
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    check_feasible(layout, nodes, tensor_parallel_size)
    # One group for a TP role (STRICT_PACK), one with the configured strategy for the rest.
    plan: list[tuple[list[str], str]] = []
    if layout.tp_role is not None:
        plan.append(([layout.tp_role], TP_STRATEGY))
    rest = [r for r in layout.roles if r != layout.tp_role]
    if rest:
        plan.append((rest, config.strategy))
    groups: dict[str, object] = {}
    index: dict[str, list[int]] = {}
    made = []
    try:
        for roles, strategy in plan:
            bundles = [b for r in roles for b in layout.roles[r]]
            group = placement_group(bundles, strategy=strategy)
            made.append(group)
            at = 0
            for r in roles:
                groups[r], index[r] = group, list(range(at, at + len(layout.roles[r])))
                at += len(layout.roles[r])
            try:
                await asyncio.wait_for(group.ready(), timeout=config.timeout_s)
            except asyncio.TimeoutError:
                raise PlacementError(
                    f"placement group {bundles} with strategy {strategy} was not ready after "
                    f"{config.timeout_s:g}s: no node (or set of nodes) can host these bundles"
                ) from None
    except BaseException:
        for group in made:
            remove_placement_group(group)
        raise
    log.info("placement ready: %s", layout.describe())
    return Placement(layout, groups, index)
