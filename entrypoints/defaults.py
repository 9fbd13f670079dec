"""The demo pair as the default model: what the entry points use when no target is given.

Only entry points (the CLI, the Serve application, batch jobs) fill it in; below them a
configuration names its checkpoints (the actors and the engine never build models).

    from specray.entrypoints.defaults import with_demo_pair
    coordinator = Coordinator.remote(with_demo_pair({}))   # the demo pair behind a coordinator
"""

from __future__ import annotations

from specray.actors.config import SpecrayConfig


def with_demo_pair(config: SpecrayConfig | dict | None = None) -> SpecrayConfig:
    """``config`` with the demo pair's paths filled in when it names no target (built once,
    cached); a config with a target is returned as it is."""
    cfg = SpecrayConfig.model_validate(config if config is not None else {})
    if cfg.target is not None:
        return cfg
    from specray.demo import load_or_build_demo_pair

    pair = load_or_build_demo_pair()
    return cfg.model_copy(update={"target": pair.target, "draft": cfg.draft or pair.draft,
                                  "tokenizer": cfg.tokenizer or pair.tokenizer})


def resolved(config: SpecrayConfig | dict | None = None) -> SpecrayConfig:
    """The demo pair filled in, then the KV cache sized (``SpecrayConfig.resolved``)."""
    return with_demo_pair(config).resolved()
