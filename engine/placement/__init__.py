"""Where vLLM instances run: on the engine's own host (``local``, the default, no Ray imported) or on the nodes of
a Ray cluster (``ray``, when ``LLMOPS_RAY_ADDRESS`` is set). One interface (engine/placement/base.py)."""

from __future__ import annotations

from engine.placement.base import NodeInfo, Placement, PlacementError
from engine.placement.local import LocalPlacement


def make_placement(ray_address: str | None, sample_interval_s: float = 1.0, allow_unauthenticated: bool = False
                   ) -> Placement:
    """The placement the configuration asks for; Ray is imported only here, only when asked for. A cluster that
    answers without Ray's token is refused (PlacementError) unless ``allow_unauthenticated``."""
    if not ray_address:
        return LocalPlacement()
    from engine.placement.cluster import RayPlacement

    placement: Placement = RayPlacement(ray_address, sample_interval_s, allow_unauthenticated)
    return placement


__all__ = ["LocalPlacement", "NodeInfo", "Placement", "PlacementError", "make_placement"]
