"""The browser's sign-in, as the console's server and its pages share it: the cookie's name and safe redirects."""

from __future__ import annotations

COOKIE = "llmops_session"  # HttpOnly, SameSite=Strict: the engine's session token, out of page scripts' reach


def safe_next(target: str | None) -> str:
    """A path on this console to return to after signing in; anything else (another site, a scheme) is '/'."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")) or any(
            c in target for c in "\r\n\t\\") or target.startswith(("/signin", "/signout")):
        return "/"
    return target[:2000]
