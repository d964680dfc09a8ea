"""Deployments: several models served by one engine, each under its own name with its own revisions, instances
and placement; the store of them, and the registry that supervises every one."""

from __future__ import annotations

from engine.deployments.fleet import Fleet, Runtime
from engine.deployments.store import (
    MAX_DEPLOYMENTS,
    Deleted,
    DeploymentError,
    DeploymentExistsError,
    DeploymentNotFoundError,
    DeploymentStore,
    check_name,
)

__all__ = ["MAX_DEPLOYMENTS", "Deleted", "DeploymentError", "DeploymentExistsError", "DeploymentNotFoundError",
           "DeploymentStore", "Fleet", "Runtime", "check_name"]
