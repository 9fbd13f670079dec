"""Placement groups: which model runs on which GPU/node, failing fast when infeasible."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specray.actors.config import ModelPlacement, PlacementConfig

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot host the requested placement."""


@dataclass
class Placement:
    """A ready placement group and the scheduling options of each role's actor."""

    group: object
    roles: list[str]
    bundles: list[dict]

    def options(self, role: str) -> dict:
        """Actor options: the role's bundle, and exactly its resources."""
        index = self.roles.index(role)
        bundle = self.bundles[index]
        return {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index
            ),
        }

    def remove(self) -> None:
        remove_placement_group(self.group)


def _gpus(spec: ModelPlacement, cluster_gpus: float) -> float:
    if spec.num_gpus is not None:
        return spec.num_gpus
    return 1.0 if cluster_gpus >= 1 else 0.0


def bundles_for(config: PlacementConfig, drafts: Sequence[str] = ()) -> tuple[list[str], list[dict]]:
    """Roles and their bundles: target (+ each draft model: ``draft``, ``pard``, with the draft's
    resources) [+ colocated together]."""
    total = ray.cluster_resources()
    gpus = total.get("GPU", 0)
    t = {"CPU": config.target.num_cpus, "GPU": _gpus(config.target, gpus)}
    if config.mode == "colocated":
        return ["engine"], [{k: v for k, v in t.items() if v > 0}]
    roles, bundles = ["target"], [t]
    for name in drafts:
        roles.append(name)
        bundles.append({"CPU": config.draft.num_cpus, "GPU": _gpus(config.draft, gpus)})
    return roles, [{k: v for k, v in b.items() if v > 0} for b in bundles]


async def reserve(config: PlacementConfig, drafts: Sequence[str] = ()) -> Placement:
    """Create and wait for the placement group, or raise PlacementError quickly."""
    roles, bundles = bundles_for(config, drafts)
    total = ray.cluster_resources()
    for resource in ("GPU", "CPU"):
        need = sum(b.get(resource, 0) for b in bundles)
        have = total.get(resource, 0)
        if need > have:
            raise PlacementError(
                f"placement needs {need:g} {resource} ({', '.join(f'{r}: {b}' for r, b in zip(roles, bundles))}) "
                f"but the cluster has {have:g}"
            )
    group = placement_group(bundles, strategy=config.strategy)
    try:
        await asyncio.wait_for(group.ready(), timeout=config.timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"placement group {bundles} with strategy {config.strategy} was not ready after "
            f"{config.timeout_s:g}s: no node (or set of nodes) can host these bundles"
        ) from None
    log.info("placement ready: %s", dict(zip(roles, bundles)))
    return Placement(group, roles, bundles)
