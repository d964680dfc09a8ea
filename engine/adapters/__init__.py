"""LoRA adapters of a deployment: whether one fits its base model (read before anything starts), and where they are
registered. The fleet (engine/deployments) serves them: at each instance's start, and live on those that serve."""

from engine.adapters.check import AdapterInfo, check_name, inspect
from engine.adapters.store import AdapterStore

__all__ = ["AdapterInfo", "AdapterStore", "check_name", "inspect"]
