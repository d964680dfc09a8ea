"""The data dir is the engine user's alone: folders 0700, the database and logs 0600 (the database holds password
hashes and token digests, the logs what vLLM printed). Light on purpose: the CLI uses it before it opens the
database, without the engine's server code."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIRS = ("", "logs", "run")  # the data dir and its folders of secrets and logs: the engine's user only


def make_private(data_dir: Path) -> None:
    """Data dir and its logs and run folders 0700, the database and logs 0600 (an older engine, or the CLI on a
    fresh data dir, left them 0644)."""
    for name in PRIVATE_DIRS:
        folder = data_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        for path in folder.iterdir() if name else data_dir.glob("llmops.db*"):
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o600)
