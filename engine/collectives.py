"""The tensor-parallel group's collectives, in one place (nothing else calls torch.distributed).

One process group per purpose, as vLLM keeps them:

    tensors  the model's all-reduces (row-parallel layers): NCCL on CUDA, gloo on CPU
    control  rank 0's step messages to the other ranks (which runner call, with what): gloo,
             whose CPU tensors need no device round trip

``init_groups`` joins a group over TCP (one process per rank: the Ray actors);
``local_groups`` builds the same pair for ranks that are threads of one process (tests, with
an in-process store), whose groups torch does not register by name.

All-reduce: eager forwards call the backend directly (in place); a forward traced by
``torch.compile`` uses the functional collective (``torch.distributed._functional_collectives``),
the form dynamo traces — an in-place ``dist.all_reduce`` compiled with fullgraph returned wrong
values here (torch 2.13, gloo).
"""

from __future__ import annotations

import datetime
import logging
import pickle
import struct
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A step's message fits one broadcast of this many bytes (length-prefixed); a longer one (a
# batch of long prompts) takes a second broadcast of the rest.
MESSAGE_BYTES = 16 * 1024
_LENGTH = struct.Struct("<q")
# The ranks other than 0 wait for the next message for as long as the server idles; the
# tensor group's collectives run inside forwards, so a rank that stops answering there is
# taken for lost after this long (the group is then rebuilt).
CONTROL_TIMEOUT = datetime.timedelta(days=365)
TENSOR_TIMEOUT = datetime.timedelta(seconds=120)


class GroupLostError(RuntimeError):
    """A collective of the tensor-parallel group failed: a rank died or stopped answering."""


@dataclass
class Groups:
    """This rank's place in its tensor-parallel group and the group's two process groups.

    tensors_name: the tensor group's registered name (functional collectives need it); None
    for groups torch does not know by name (``local_groups``), which then cannot be compiled.
    """

    rank: int
    size: int
    tensors: object  # a torch ProcessGroup
    control: object
    tensors_name: str | None = None
    device: torch.device = torch.device("cpu")  # where the tensor group's tensors live (NCCL: this rank's GPU)
    _in_flight: list = field(default_factory=list, repr=False)  # rank 0's broadcasts not yet complete
    # Eager all-reduces so far and the seconds spent in them (waiting for the other ranks included).
    reduces: int = 0
    reduce_seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (every rank gets it)."""
        if torch.compiler.is_compiling():
            if self.tensors_name is None:
                raise RuntimeError("this tensor-parallel group has no registered name: it cannot be compiled")
            import torch.distributed._functional_collectives as funcol

            return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.tensors_name))
        x = x.contiguous()
        start = time.perf_counter()
        try:
            self.tensors.allreduce([x]).wait()
        except RuntimeError as exc:
            raise GroupLostError(f"tensor-parallel all-reduce failed on rank {self.rank}: {exc}") from exc
        self.reduces += 1
        self.reduce_seconds += time.perf_counter() - start
        return x

    # -- the control plane: rank 0 broadcasts, the others receive ----------------------------
    def send(self, message) -> int:
        """Rank 0: broadcast ``message`` (any picklable value) to the other ranks; returns its bytes.

        It does not wait for the broadcast to complete (gloo runs it on its own threads): rank 0
        goes on to its forward, whose first all-reduce meets the other ranks once they have the
        message. The previous message's broadcast is waited for first, so at most one is in flight.
        """
        self.settle()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        first = data[: MESSAGE_BYTES - _LENGTH.size]
        head[: _LENGTH.size + len(first)] = torch.frombuffer(bytearray(_LENGTH.pack(len(data)) + first),
                                                             dtype=torch.uint8)
        self._broadcast(head)
        if len(data) > len(first):
            self._broadcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8))
        return len(data)

    def receive(self):
        """Ranks > 0: the next message rank 0 sends (blocks until it comes)."""
        head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        self._broadcast(head)
        raw = head.numpy().tobytes()
        (length,) = _LENGTH.unpack_from(raw)
        data = raw[_LENGTH.size: _LENGTH.size + length]
        if length > len(data):
            rest = torch.empty(length - len(data), dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast(self, buf: torch.Tensor) -> None:
        try:
            work = self.control.broadcast(buf, 0)
            if self.rank == 0:
                self._in_flight.append((work, buf))  # the buffer lives until the broadcast is done
            else:
                work.wait()
        except RuntimeError as exc:
            raise GroupLostError(f"tensor-parallel control broadcast failed on rank {self.rank}: {exc}") from exc

    def settle(self) -> None:
        """Wait for rank 0's broadcasts in flight (their failure is a lost group)."""
        in_flight, self._in_flight = self._in_flight, []
        for work, _ in in_flight:
            try:
                work.wait()
            except RuntimeError as exc:
                raise GroupLostError(f"tensor-parallel control broadcast failed on rank {self.rank}: {exc}") from exc


def init_groups(address: str, rank: int, size: int, device: torch.device | str) -> Groups:
    """Join the group at ``address`` (``host:port`` of rank 0's store) as ``rank`` of ``size``:
    the tensor group on NCCL for a CUDA device, else gloo; the control group on gloo."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=TENSOR_TIMEOUT, device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    world = dist.group.WORLD
    log.info("tensor-parallel rank %d of %d joined %s (%s tensors, gloo control)", rank, size, address, backend)
    return Groups(rank, size, world, control, tensors_name=world.group_name, device=device)


def local_groups(store, rank: int, size: int) -> Groups:
    """Gloo groups for ranks that are threads of one process, over a shared ``dist.HashStore``
    (their tensors all on the CPU)."""
    tensors = dist.ProcessGroupGloo(dist.PrefixStore("tensors", store), rank, size, TENSOR_TIMEOUT)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
    return Groups(rank, size, tensors, control)


def leave_groups() -> None:
    """Leave the process's registered groups (``init_groups``), if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
