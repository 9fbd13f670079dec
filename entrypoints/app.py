"""Builders of the Serve application, from Python or a ``serve run`` YAML.

    from specray.entrypoints.app import build_app
    serve.run(build_app({"model_name": "demo", "autoscaling": {"max_replicas": 2}}))

YAML (``serve run examples/serve.yaml``)::

    applications:
      - name: specray
        import_path: specray.entrypoints.app:build_app
        args: {model_name: specray-demo, engine: {max_num_seqs: 8}}
"""

from __future__ import annotations

from ray import serve

from specray.entrypoints.defaults import resolved
from specray.serve.config import ServeConfig
from specray.serve.deployment import EngineDeployment
from specray.serve.ingress import OpenAIIngress

# Replicas are light; their coordinator reserves the models' GPUs in its own
# placement group.
REPLICA_CPUS = 0.1


def build_app(config: ServeConfig | dict | None = None):
    """The ingress bound to the engine deployment (a Serve ``Application``)."""
    cfg = ServeConfig.model_validate(config if config is not None else {})
    # Resolve the demo pair once here, not once per replica.
    cfg = cfg.model_copy(update={"engine": resolved(cfg.engine)})
    scaling = (
        {"autoscaling_config": cfg.autoscaling.model_dump(exclude_none=True)}
        if cfg.autoscaling is not None
        else {"num_replicas": cfg.num_replicas}
    )
    # Each replica (and, inheriting it, every worker an engine replica starts) in the runtime environment asked for.
    replica = {"num_cpus": REPLICA_CPUS, **({"runtime_env": cfg.runtime_env} if cfg.runtime_env else {})}
    engine = serve.deployment(EngineDeployment).options(
        name="SpecrayEngine",
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        ray_actor_options=replica,
        health_check_period_s=10,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_s,
        **scaling,
    )
    # The ingress only forwards: it must admit every request the engines may hold or
    # queue (Serve's default would cap the whole server at 5 requests in flight), so that
    # the engines' bounded queues, not a hidden ingress queue, decide what gets a 503.
    most = cfg.autoscaling.max_replicas if cfg.autoscaling is not None else cfg.num_replicas
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress",
        max_ongoing_requests=most * (cfg.max_ongoing_requests + cfg.max_queued_requests) + 8,
        ray_actor_options=replica,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_s,
    )
    return ingress.bind(engine.bind(cfg.model_dump()), cfg.model_dump())
