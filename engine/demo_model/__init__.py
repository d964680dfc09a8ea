"""The embedded demo model and its LoRA adapter, trained offline (torch; not imported by the server)."""

from __future__ import annotations

from engine.demo_model.lora import DemoLoraSpec, build_demo_lora
from engine.demo_model.train import DemoModelSpec, build_demo_model

__all__ = ["DemoLoraSpec", "DemoModelSpec", "build_demo_lora", "build_demo_model"]
