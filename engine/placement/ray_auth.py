"""Whether a Ray cluster asks for its token: a cluster without Ray's token authentication runs code for anyone who
reaches its ports (a Ray client on the GCS port ran a task as root; the job API a shell command), and through it
reads the engine's database and its admin token (issue 31). Before the engine becomes a driver of a cluster, it
asks the cluster's GCS for a key with no token, in a child process of its own (Ray's auth mode is a process-wide
setting): answered, the cluster is open and the engine refuses it, unless told to accept one
(``ray_allow_unauthenticated``), then says so loudly in its log and events.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from engine.placement.base import PlacementError

PROBE_TIMEOUT_S = 30.0
# the child asks the GCS once, as a client without a token would; exit 0: answered, 3: refused for want of a
# token, 4: anything else (not reachable, not a Ray GCS): the driver's own connection will say what
_PROBE = r"""
import sys
try:
    from ray._private import services
    from ray._raylet import GcsClient
    address = services.canonicalize_bootstrap_address_or_die(sys.argv[1])
    GcsClient(address=address).internal_kv_get(b"llmops-auth-probe", None, timeout=10)
except Exception as exc:
    text = f"{type(exc).__name__}: {exc}"
    print(text[:500])
    low = text.lower()
    sys.exit(3 if any(w in low for w in ("auth", "unauthenticated", "token")) else 4)
"""

Verdict = Literal["open", "token", "unknown"]


@dataclass(frozen=True)
class AuthCheck:
    verdict: Verdict
    detail: str


def probe(address: str) -> AuthCheck:
    """Ask the cluster at ``address`` for a key with no token: "open" when it answers, "token" when it refuses for
    want of one, "unknown" when it cannot be asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env["RAY_AUTH_MODE"] = "disabled"
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, address], env=env, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=False, start_new_session=True)
    except subprocess.TimeoutExpired:
        return AuthCheck("unknown", f"no answer within {PROBE_TIMEOUT_S:g} s")
    detail = (done.stdout.strip() or done.stderr.strip()[-500:])
    verdict: Verdict = {0: "open", 3: "token"}.get(done.returncode, "unknown")  # type: ignore[assignment]
    return AuthCheck(verdict, detail)


OPEN_MESSAGE = ("the Ray cluster at {address} answers without a token: anyone who reaches its ports can run code "
                "on every node as the user Ray runs as, and read this engine's database and admin token. Start "
                "every node with RAY_AUTH_MODE=token (and the same RAY_AUTH_TOKEN, or ~/.ray/auth_token) and bind it "
                "to a private interface (docs/fleet.md); to use it anyway, set LLMOPS_RAY_ALLOW_UNAUTHENTICATED=true")


def require_token(address: str, allow_open: bool) -> AuthCheck:
    """The cluster's verdict; PlacementError when it is open and that was not explicitly allowed."""
    check = probe(address)
    if check.verdict == "open" and not allow_open:
        raise PlacementError(OPEN_MESSAGE.format(address=address))
    return check
