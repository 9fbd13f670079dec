"""The cluster manifests (cluster/): the Ray cluster-launcher YAML passes the launcher's own
checks, the KubeRay RayService has every key its CRD requires, both run cluster/serve.yaml's
application, its builder makes specray's Serve app from the manifest's args with no cluster, and
``serve run`` of the same Serve config answers a request (on the tiny pair, in FP8 as the
manifest asks)."""

from __future__ import annotations

import copy
import importlib
import pathlib

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")

from tests.conftest import decode, encode, free_port, hf_greedy  # noqa: E402

CLUSTER = pathlib.Path(__file__).resolve().parents[1] / "cluster"


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def rayservice_serve_config() -> dict:
    """The RayService's serveConfigV2: a string holding a Serve config (KubeRay's CRD: type string)."""
    text = load("rayservice.yaml")["spec"]["serveConfigV2"]
    assert isinstance(text, str)
    return yaml.safe_load(text)


# -- the cluster launcher ----------------------------------------------------------------------
def test_the_launcher_yaml_passes_rays_own_checks():
    """What `ray up` runs before it launches anything: the defaults of the provider filled in,
    then ray-schema.json and the launcher's semantic checks (head node type, worker counts)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    doc = load("ray-cluster.yaml")
    config = prepare_config(copy.deepcopy(doc))
    validate_config(config)
    types = doc["available_node_types"]
    assert doc["head_node_type"] in types and types[doc["head_node_type"]]["resources"] == {"CPU": 0}
    workers = [t for name, t in types.items() if name != doc["head_node_type"]]
    assert workers and all(t["min_workers"] >= 1 and t["max_workers"] <= doc["max_workers"] for t in workers)
    # this checkout on every node, pip-installed there; Ray started on head and workers
    (remote, local), = doc["file_mounts"].items()
    assert local == "." and any(f"pip install" in c and remote in c for c in doc["setup_commands"])
    assert any("ray start --head" in c for c in doc["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in doc["worker_start_ray_commands"])
    # the models serve.yaml names are downloaded on the GPU nodes
    engine = load("serve.yaml")["applications"][0]["args"]["engine"]
    for path in (engine["target"], engine["draft"]):
        assert any(f"--local-dir {path}" in c for c in doc["worker_setup_commands"]), path


# -- KubeRay ------------------------------------------------------------------------------------
def test_the_rayservice_has_what_kuberays_crd_requires():
    """Required keys of ray-project/kuberay's ray.io_rayservices.yaml (ray.io/v1; v1alpha1 also
    required rayStartParams, kept here): spec.rayClusterConfig.headGroupSpec.template.spec.containers,
    each worker group's groupName, minReplicas, maxReplicas and template; serveConfigV2 a string."""
    doc = load("rayservice.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService") and doc["metadata"]["name"]
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict) and head["rayStartParams"]["num-cpus"] == "0"
    images = {c["image"] for c in head["template"]["spec"]["containers"]}
    assert head["template"]["spec"]["containers"][0]["name"]
    for group in cluster["workerGroupSpecs"]:
        assert {"groupName", "minReplicas", "maxReplicas", "template", "rayStartParams"} <= set(group)
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers)
        images |= {c["image"] for c in containers}
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in containers]
        assert gpus == [1]  # one engine replica per GPU pod (serve.yaml: num_gpus 1)
        mounts = {m["mountPath"] for c in containers + group["template"]["spec"]["initContainers"]
                  for m in c["volumeMounts"]}
        assert mounts == {"/models"}
    assert len(images) == 1  # head and workers run one image (cluster/Dockerfile)
    assert cluster["rayVersion"] in (CLUSTER / "Dockerfile").read_text()  # the image's Ray is rayVersion's
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(rayservice_serve_config())  # a Serve config Ray accepts


def test_both_manifests_run_the_same_serve_application():
    assert rayservice_serve_config()["applications"] == load("serve.yaml")["applications"]
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(load("serve.yaml"))


def test_the_rayservice_serve_config_builds_specrays_app():
    """Serve's controller imports import_path and calls it with args: here, with no cluster and
    none of the models present (building reads no weights; they load in the replicas)."""
    from ray.serve import Application

    from specray.serve.config import ServeConfig

    for app in rayservice_serve_config()["applications"]:
        module, name = app["import_path"].split(":")
        builder = getattr(importlib.import_module(module), name)
        built = builder(app["args"])
        assert isinstance(built, Application)
        config = ServeConfig.model_validate(app["args"])
        assert config.engine.quantization == "fp8" and config.engine.placement.target.num_gpus == 1
        assert config.engine.engine_config().max_num_seqs == 16


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(300)
def test_serve_run_of_the_manifests_serve_config_answers(tmp_path, tiny_tok, tiny_pair):
    """The RayService's Serve config through `serve run`, with the tiny pair (and its tokenizer)
    in place of the models, on CPU and a free loopback port: a completion equal to the FP8 tiny
    target's greedy continuation."""
    from specray.engine.quantization import quantize_linears
    from tests.test_serve_autoscale import serve_run

    doc = rayservice_serve_config()
    port = free_port()
    doc["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = doc["applications"]
    args = app["args"]
    args["engine"].update(target=tiny_tok["target"], draft=tiny_tok["draft"], tokenizer=tiny_tok["tokenizer"],
                          max_model_len=256, max_num_seqs=4)
    args["engine"]["placement"]["target"] = {"num_gpus": 0, "num_cpus": 0.5}  # fits a 2-CPU machine, no GPU
    args["autoscaling"]["max_replicas"] = 1
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(doc))
    target = copy.deepcopy(tiny_pair[0])
    quantize_linears(target)
    expected = decode(hf_greedy(target, encode("abcabcab"), 8))

    with serve_run(config, tmp_path, port) as base:
        model = args["model_name"]
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == model
        body = {"model": model, "prompt": "abcabcab", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["choices"][0]["text"] == expected
        assert reply["speculation_metrics"][0]["method"] == "draft"
