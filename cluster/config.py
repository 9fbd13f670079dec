"""Re-export: the deployment config lives with the actors that use it (``specray.actors.config``)."""

from specray.actors.config import ModelPlacement, PlacementConfig, SpecrayConfig  # noqa: F401
