"""Online learning on Ray: replicas converge to the versions the learner hub publishes (a late
one too), output stays the target's throughout, and faults — the trainer killed mid-training,
the hub killed, a candidate forced worse — never reach serving."""

import time

import pytest
import ray

from tests.conftest import hf_greedy

PROMPTS = [[5, 9, 2, 7, 5, 9], [1, 2, 3, 1, 2], [40, 41, 42, 40], [7, 7, 8, 9, 10, 7], [3, 1, 4, 1, 5, 9, 2, 6],
           [11, 12, 11, 12, 13], [60, 2, 60, 3, 60], [20, 30, 40, 20, 30]]
GREEDY = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
SPEC = {"method": "draft", "num_speculative_tokens": 3}


def config(tiny_checkpoints, name: str, trainer: str, **online) -> dict:
    return {**tiny_checkpoints, "max_num_seqs": 4, "placement": {"mode": "colocated", "target": {"num_gpus": 0}},
            "online_learning": {"enabled": True, "name": name, "trainer": f"tests.online_trainers:{trainer}",
                                "round_requests": 8, "min_tokens": 4, "sync_interval_s": 0.2,
                                "gate_options": {"draft": {"num_speculative_tokens": 3}},
                                "trainer_resources": {"num_cpus": 0.1}, **online}}


def serve(c, prompts=PROMPTS) -> list[dict]:
    return ray.get(c.generate.remote(prompts, GREEDY, SPEC))


def wait_for(check, timeout: float = 240.0, what: str = ""):
    """Poll ``check()`` until it returns something truthy (learning runs in other actors)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [hf_greedy(tiny_pair[0], p, GREEDY["max_tokens"]) for p in PROMPTS]


def test_replicas_converge_to_what_the_learner_publishes(ray_session, tiny_checkpoints, references, tmp_path):
    from specray.actors.coordinator import Coordinator
    from specray.actors.learner import OnlineLearningConfig, drop_learner
    from tests.test_actors import shutdown

    cfg = config(tiny_checkpoints, "test-online-converge", "fast")
    a, late = Coordinator.remote(cfg), None
    try:
        for _ in range(2):  # its traffic fills a round
            assert [o["token_ids"] for o in serve(a)] == references
        wait_for(lambda: ray.get(a.drafters.remote("status"))["serving"].get("draft") not in (None, "draft@base"),
                 what="a published version")
        ray.get(a.drafters.remote("learning", enabled=False))  # the runtime switch: no new rounds
        status = wait_for(lambda: (s := ray.get(a.drafters.remote("status")))["trainer"]["state"] == "idle" and s,
                          what="the trainer to finish its round")
        version = status["serving"]["draft"]
        assert any(r["published"] and r["version"] == version for r in status["rounds"]), status["rounds"]
        assert status["learning"] == "off"
        # the replica swaps it in, and serves the target's tokens under it
        wait_for(lambda: ray.get(a.drafters.remote("status"))["replica"]["serving"]["draft"] == version,
                 what="the replica to swap the version in")
        outs = serve(a)
        assert [o["token_ids"] for o in outs] == references
        assert {o["metrics"]["drafter_version"] for o in outs} == {version}
        late = Coordinator.remote(cfg)  # a replica that joins later gets the latest at its first exchange
        assert [o["token_ids"] for o in serve(late, PROMPTS[:2])] == references[:2]
        wait_for(lambda: ray.get(late.drafters.remote("status"))["replica"]["serving"]["draft"] == version,
                 what="the late replica")
        # export it in the public layout, and load it back through the API: every replica serves it
        path = ray.get(a.drafters.remote("export", method="draft", version=version, path=str(tmp_path / "v")))["path"]
        loaded = ray.get(late.drafters.remote("load", method="draft", path=path))["version"]
        assert loaded == "draft@v"
        for c in (a, late):
            wait_for(lambda: ray.get(c.drafters.remote("status"))["replica"]["serving"]["draft"] == loaded,
                     what="the loaded version")
        assert [o["token_ids"] for o in serve(a, PROMPTS[:2])] == references[:2]
        # pin the base version back, everywhere; then unpin
        ray.get(a.drafters.remote("pin", method="draft", version="draft@base"))
        for c in (a, late):
            wait_for(lambda: ray.get(c.drafters.remote("status"))["replica"]["serving"]["draft"] == "draft@base",
                     what="the pinned version")
        with pytest.raises(ValueError, match="missing method"):
            ray.get(a.drafters.remote("rollback"))
    finally:
        for c in (a, late):
            if c is not None:
                shutdown(c)
        drop_learner(OnlineLearningConfig.model_validate(cfg["online_learning"]), "")


def test_a_worse_candidate_faults_and_loaded_versions_never_reach_the_output(ray_session, tiny_checkpoints, tiny_pair,
                                                                            references, tmp_path):
    """One replica in the separate layout (the draft model in a worker of its own), the target
    drafting for itself (it accepts everything), shows in turn:

    1. a candidate forced worse is judged by the gate and never served;
    2. the trainer killed in the middle of a round, then the hub killed: every request completes
       with the target's tokens, and a new hub takes over with the serving version unchanged;
    3. a loaded version reaches the draft worker, which swaps it in place and rebuilds its slots
       (a scrambled version accepts almost nothing; the target's weights loaded back, everything).

    Throughout, the output is the target's."""
    import copy

    import torch

    from specray.actors.coordinator import Coordinator
    from specray.actors.learner import NAMESPACE, OnlineLearningConfig, drop_learner
    from tests.serving import workers_up
    from tests.test_actors import shutdown

    scrambled = copy.deepcopy(tiny_pair[0])
    with torch.no_grad():
        for p in scrambled.parameters():
            p.copy_(torch.randn_like(p))
    scrambled.save_pretrained(tmp_path / "scrambled")
    name = "test-online-separate"
    cfg = {**config(tiny_checkpoints, name, "worse_then_slow", buffer_mb=0.05), "draft": tiny_checkpoints["target"],
           "placement": {"mode": "separate", "target": {"num_gpus": 0}, "draft": {"num_gpus": 0}}}
    c = Coordinator.remote(cfg)

    def acceptance(outs):
        return sum(o["metrics"]["num_accepted_tokens"] for o in outs) / sum(o["metrics"]["num_draft_tokens"] for o in outs)

    try:
        workers_up(c)  # the draft worker drafts from the first request (acceptance counts its drafts)
        # 1. The first round (its traffic fills it) scrambles its candidate: the gate refuses it.
        for _ in range(2):
            outs = serve(c)
            assert [o["token_ids"] for o in outs] == references and acceptance(outs) == 1.0
        status = wait_for(lambda: (s := ray.get(c.drafters.remote("status")))["rounds"] and s, what="a round")
        assert not any(r["published"] for r in status["rounds"])
        assert status["serving"]["draft"] == "draft@base" == status["replica"]["serving"]["draft"]
        assert [v["version"] for v in status["versions"]["draft"]] == ["draft@base"]
        assert status["buffer"]["bytes"] <= status["buffer"]["max_bytes"] == int(0.05 * 2**20)
        outs = serve(c)  # (the traffic since the first round starts the next one, a long one)
        assert [o["token_ids"] for o in outs] == references
        assert {o["metrics"]["drafter_version"] for o in outs} == {"draft@base"}

        # 2. The trainer killed in the middle of a round, then the hub.
        wait_for(lambda: ray.get(c.drafters.remote("status"))["trainer"]["state"].startswith("training"),
                 what="a round to start")
        ray.kill(ray.get_actor(f"{name}-trainer", namespace=NAMESPACE), no_restart=False)
        assert [o["token_ids"] for o in serve(c)] == references
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        refs = [c.generate.remote([p], GREEDY, SPEC) for p in PROMPTS]  # in flight while the hub is gone
        assert [ray.get(r)[0]["token_ids"] for r in refs] == references
        status = wait_for(lambda: ray.get(c.drafters.remote("status")), what="a new hub")
        assert status["replica"]["serving"]["draft"] == "draft@base"
        assert status["buffer"]["bytes"] <= status["buffer"]["max_bytes"]
        ray.get(c.drafters.remote("learning", enabled=False))  # the runtime switch, on the new hub
        assert ray.get(c.drafters.remote("status"))["learning"] == "off"

        # 3. Loaded versions, served from the next step on.
        for path, version, check in ((tmp_path / "scrambled", "draft@scrambled", lambda a: a < 0.5),
                                     (tiny_checkpoints["target"], "draft@target", lambda a: a == 1.0)):
            assert ray.get(c.drafters.remote("load", method="draft", path=str(path)))["version"] == version
            outs = serve(c)
            assert [o["token_ids"] for o in outs] == references
            assert {o["metrics"]["drafter_version"] for o in outs} == {version} and check(acceptance(outs))
    finally:
        shutdown(c)
        drop_learner(OnlineLearningConfig.model_validate(cfg["online_learning"]), "")


def test_a_trainer_that_cannot_be_placed_is_named_in_the_status(ray_session):
    """Never a silent wait: what the engines report (``trainer_placement``) names what the
    trainer waits for and what is free, and the hub's status says it."""
    from specray.actors.learner import OnlineLearningConfig, drop_learner, hub_for, trainer_placement

    cfg = OnlineLearningConfig(enabled=True, name="test-online-unplaceable", trainer_resources={"num_cpus": 64})
    hub, _ = hub_for(cfg, "model")
    try:
        placement = trainer_placement(cfg, "model")
        assert placement["state"] == "pending" and placement["resources"] == {"CPU": 64.0}, placement
        ray.get(hub.note_placement.remote(placement))
        state = ray.get(hub.status.remote())["trainer"]["state"]
        assert state.startswith("pending: the trainer waits for CPU 64 (free now: CPU ") and "trainer_resources" in state
    finally:
        drop_learner(cfg, "model")
