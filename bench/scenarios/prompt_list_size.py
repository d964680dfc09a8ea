"""Size of the saved-prompt list the playground reads on every run of its page: ``--prompts`` prompts as large as
the engine accepts, saved by one user, then ``GET /api/prompts`` (the first page, as the console asks for it).

    python -m bench prompt-list --prompts 40

Prints JSON and writes it to ``prompt-list.json`` under ``--out``: how many were accepted, the largest accepted
prompt and the response's size in bytes and MiB.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.testkit.data import make_data_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=40)


def run(args: argparse.Namespace) -> None:
    data_dir = make_data_dir(Path(tempfile.mkdtemp(prefix="prompt-list-")))
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password="bench-password-0123"))
    token, _ = app.state.services.auth.create_token("bench", "prompter")
    config = app.state.services.config
    largest = config.prompt_max_chars
    accepted = 0
    with TestClient(app, headers={"authorization": f"Bearer {token}"}) as client:
        for i in range(args.prompts):
            body = {"name": f"prompt {i}", "system": "", "prompt": "x" * largest,
                    "params": {"format": "Text"}}
            if client.post("/api/prompts", json=body).status_code == 201:
                accepted += 1
        listed = client.get("/api/prompts", params={"limit": 100})
        assert listed.status_code == 200, listed.text
    size = len(listed.content)
    report = {"asked": args.prompts, "accepted": accepted, "prompt_chars": largest,
              "per_user": config.prompts_per_user, "listed": len(listed.json()), "bytes": size,
              "mib": round(size / (1 << 20), 2)}
    print(json.dumps(report))
    (args.out / "prompt-list.json").write_text(json.dumps(report, indent=1) + "\n")

