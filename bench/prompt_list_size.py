"""Size of the saved-prompt list the playground reads on every run of its page: ``--prompts`` prompts as large as
the engine accepts, saved by one user, then ``GET /api/prompts`` (the first page, as the console asks for it).

    python bench/prompt_list_size.py --prompts 40

Prints JSON: how many were accepted, the largest accepted prompt and the response's size in bytes and MiB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.support.data import make_data_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=40)
    args = parser.parse_args()
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
    print(json.dumps({"asked": args.prompts, "accepted": accepted, "prompt_chars": largest,
                      "per_user": config.prompts_per_user, "listed": len(listed.json()), "bytes": size,
                      "mib": round(size / (1 << 20), 2)}))


if __name__ == "__main__":
    main()
