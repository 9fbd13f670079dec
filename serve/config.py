"""Configuration of the Serve application (pydantic; from Python, YAML or the CLI).

Ray Serve silently ignores unknown ``autoscaling_config`` keys, so a typo would quietly
disable autoscaling; here the keys are checked against a strict model first.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specray.actors.config import SpecrayConfig


class AutoscalingSpec(BaseModel):
    """Ray Serve's ``autoscaling_config`` keys that specray passes through, strictly."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    initial_replicas: int | None = Field(None, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(3.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_interval_s: float | None = Field(None, gt=0, description="Deprecated by Ray; passed only if set.")
    look_back_period_s: float = Field(5.0, gt=0)
    upscaling_factor: float | None = Field(None, gt=0)
    downscaling_factor: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _order(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self


class ServeConfig(BaseModel):
    """One OpenAI-compatible application: a model served by autoscaling engine replicas.

    >>> ServeConfig(model_name="demo", autoscaling={"min_replicas": 1, "max_replicas": 2})  # doctest: +SKIP
    """

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("specray-demo", min_length=1, description="The id clients pass as `model`.")
    engine: SpecrayConfig = Field(default_factory=SpecrayConfig, description="Models, batch and placement.")
    num_replicas: int = Field(1, ge=1, description="Engine replicas when autoscaling is off.")
    autoscaling: AutoscalingSpec | None = Field(None, description="Ray Serve autoscaling (strict keys).")
    max_ongoing_requests: int = Field(32, ge=1, description="Requests in flight per engine replica.")
    max_queued_requests: int = Field(64, ge=0, description="Beyond this queue, 503 (bounded, never unbounded).")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request gives none (OpenAI: 16).")
    api_key: str | None = Field(
        None, description="Bearer token clients must send; default from $SPECRAY_API_KEY; None = open."
    )
    host: str = Field("127.0.0.1")
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = Field("/")

    def resolved_api_key(self) -> str | None:
        return self.api_key if self.api_key is not None else os.environ.get("SPECRAY_API_KEY") or None
