"""A tensor-parallel target's ranks as Ray actors: rank 0 is the engine worker, ranks 1.. these.

The engine worker (``actors/engine_worker.py``) starts its group with ``TensorParallelGroup``:
it creates one ``TensorParallelRank`` actor per further rank in the bundles the coordinator
reserved (``cluster/placement.py``: STRICT_PACK on one node), and every rank joins the
group's process groups at rank 0's address (``engine/collectives.py``). There is no Ray call
per step: each rank's thread waits on the group's control channel for rank 0's runner calls
and repeats them on its shard (``engine/mirror.py``). The ranks are owned by the engine
worker, so they end with it; a lost rank is found by ``TensorParallelGroup.lost`` and the
coordinator rebuilds the whole replica (a new engine worker, hence a new group).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import ray

from specray.actors.proposer_worker import Placed, on_this_device, set_worker_threads
from specray.engine.collectives import GroupLostError, init_groups, leave_groups
from specray.engine.config import EngineConfig
from specray.engine.mirror import Follower, ShardedRunners
from specray.engine.gc_pauses import freeze_loaded_heap

log = logging.getLogger(__name__)

RANK_CHECK_TIMEOUT_S = 10.0  # how long a rank may take to answer "are you there" after a failed step


class TensorParallelRank(Placed):
    """Rank ``rank`` (> 0) of a group: joins it, then serves rank 0's calls on a thread of its own
    (the actor stays free to answer ``stats`` and health checks)."""

    def __init__(self, address: str, rank: int, size: int, config: EngineConfig):
        set_worker_threads()
        config = on_this_device(config)
        self.groups = init_groups(address, rank, size, config.resolved_device)
        self.follower = Follower(self.groups, config.resolved_device)
        self.error: str | None = None
        freeze_loaded_heap()
        self._thread = threading.Thread(target=self._serve, name=f"tp-rank-{rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.follower.serve()
        except GroupLostError as exc:  # rank 0 (or a peer) went away: this rank is done too
            self.error = str(exc)
            log.error("%s", exc)
        finally:
            leave_groups()

    def stats(self) -> dict:
        """The control plane's cost on this rank, and whether it still serves."""
        return {**self.follower.stats.to_dict(), "reduces": self.groups.reduces,
                "reduce_seconds": self.groups.reduce_seconds, "serving": self._thread.is_alive(), "error": self.error}


class TensorParallelGroup:
    """Rank 0's view of its group: the other ranks' actors and the runner factory the engine
    uses (``ShardedRunners``: the target, and the draft at ``draft_tensor_parallel_size`` N,
    split and mirrored).

    rank_options: actor options of ranks 1.. (their placement bundles), from the coordinator.
    """

    def __init__(self, config: EngineConfig, rank_options: list[dict]):
        size = config.tensor_parallel_size
        if len(rank_options) != size - 1:
            raise ValueError(f"tensor_parallel_size {size} needs options for {size - 1} further ranks, "
                             f"got {len(rank_options)}")
        address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        cls = ray.remote(TensorParallelRank)
        self.ranks = [cls.options(**opts).remote(address, r, size, config) for r, opts in enumerate(rank_options, 1)]
        self.groups = init_groups(address, 0, size, config.resolved_device)
        self.runners = ShardedRunners(self.groups, config)

    async def lost(self, error: BaseException | None = None) -> str | None:
        """After a failed step: which rank was lost (named), or None if every rank still serves
        and the group did not break."""
        for rank, handle in enumerate(self.ranks, 1):
            try:
                state = await asyncio.wait_for(handle.stats.remote(), RANK_CHECK_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - dead, or not answering: lost either way
                return (f"tensor-parallel rank {rank} of {len(self.ranks) + 1} (actor "
                        f"{handle._actor_id.hex()[:12]}) was lost: {type(exc).__name__}")
            if not state["serving"]:
                return f"tensor-parallel rank {rank} of {len(self.ranks) + 1} stopped: {state['error']}"
        if isinstance(error, GroupLostError):
            return f"the tensor-parallel group broke: {error}"
        return None

    async def stats(self) -> dict:
        """The control plane's cost: rank 0's (sending) and each further rank's (receiving)."""
        ranks = await asyncio.gather(*(h.stats.remote() for h in self.ranks))
        rank0 = {**self.runners.mirror.stats.to_dict(), "reduces": self.groups.reduces,
                 "reduce_seconds": self.groups.reduce_seconds}
        return {"rank0": rank0, "ranks": ranks}


def _free_port() -> int:
    """A TCP port free now on this node, for rank 0's rendezvous store."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
