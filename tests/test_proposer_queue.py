"""The separate layout's proposer calls: prefill/commit/release wait in the proxy and travel, in
order, with the next propose (one actor call per step); a failing one fails alone. No Ray: the
proxy's handle is a recorder, the worker's operations are stubs."""

import asyncio

import pytest

from specray.actors.proposer_proxy import FLUSH_AFTER, RemoteProposer
from specray.actors.proposer_worker import ProposerWorker
from specray.policies.base import Draft, DraftRow, ProposalRow


class _Method:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))
        if self.name == "propose":  # the worker's reply: one draft per row asked for
            future = asyncio.get_running_loop().create_future()
            future.set_result(Draft([DraftRow([7]) for _ in args[1]]))
            return future
        return None


class _Handle:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return _Method(self.calls, name)


def _proxy() -> RemoteProposer:
    proxy = object.__new__(RemoteProposer)  # no actor: the handle records what would be sent
    proxy.name, proxy.overlap, proxy.hits, proxy.rows, proxy.restarts = "draft", False, 0, 0, 0
    proxy.handle, proxy._ready = _Handle(), True
    proxy._sent, proxy._ahead, proxy._ahead_len, proxy._pending = {}, None, {}, []
    return proxy


def test_operations_travel_with_the_next_propose_in_order():
    proxy = _proxy()
    proxy.prefill(["p"])
    proxy.commit(["c"])
    proxy.release(3)
    assert proxy.handle.calls == []  # nothing sent yet: no call of their own
    rows = [ProposalRow(slot=0, token_ids=[1, 2, 3], num_tokens=1)]
    draft = asyncio.run(proxy.propose(rows))
    assert [r.tokens for r in draft.rows] == [[7]]
    (name, (ops, tails)), = proxy.handle.calls
    assert name == "propose"
    assert ops == [("prefill", ["p"]), ("commit", ["c"]), ("release", [3])]
    assert [offset for offset, _ in tails] == [0]
    proxy.commit(["c2"])
    asyncio.run(proxy.propose([ProposalRow(slot=0, token_ids=[1, 2, 3, 4], num_tokens=1)]))
    name, (ops, tails) = proxy.handle.calls[-1]
    assert ops == [("commit", ["c2"])] and [(o, list(r.token_ids)) for o, r in tails] == [(3, [4])]


def test_waiting_operations_are_bounded_and_flushed_when_idle():
    proxy = _proxy()
    for i in range(FLUSH_AFTER + 5):
        proxy.commit([i])
    (name, (ops,)), = proxy.handle.calls  # the first FLUSH_AFTER went in a call of their own
    assert name == "apply" and [a for _, a in ops] == [[i] for i in range(FLUSH_AFTER)]
    proxy.flush()
    name, (ops,) = proxy.handle.calls[-1]
    assert name == "apply" and [a for _, a in ops] == [[i] for i in range(FLUSH_AFTER, FLUSH_AFTER + 5)]
    proxy.flush()  # nothing waits: nothing sent
    assert len(proxy.handle.calls) == 2
    proxy.release(1)
    proxy.load_version({"w": 1})  # a version goes at once, after what waited (its weights never pile up)
    assert proxy.handle.calls[-1] == ("apply", ([("release", [1]), ("load_version", {"w": 1})],))


def test_a_failing_operation_does_not_drop_the_ones_after_it():
    worker = object.__new__(ProposerWorker)  # no model: the operations are stubs
    done = []

    def broken(rows):
        raise RuntimeError("a stale slot")

    worker.prefill, worker.commit = broken, lambda rows: done.append(("commit", rows))
    worker.release = lambda slots: done.append(("release", slots))
    worker.apply([("prefill", ["p"]), ("commit", ["c"]), ("release", [1])])
    assert done == [("commit", ["c"]), ("release", [1])]
    with pytest.raises(ValueError, match="not a queued proposer operation"):
        worker.apply([("propose", [])])
