"""The embedded demo model, trained offline (torch; not imported by the server)."""

from __future__ import annotations

from engine.demo_model.train import DemoModelSpec, build_demo_model

__all__ = ["DemoModelSpec", "build_demo_model"]
