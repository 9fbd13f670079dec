"""Re-export: placement groups live with the actors they place (``specray.actors.placement``)."""

from specray.actors.placement import Placement, PlacementError, bundles_for, reserve  # noqa: F401
