"""Who an identity provider says signed in, as a console user name."""

from __future__ import annotations


def sso_username(claims: dict[str, object]) -> str | None:
    """The console user an identity provider's claims name: its email, only when the provider says it verified it
    (an unverified email is whatever the person typed: another user's address would open their session)."""
    email = claims.get("email")
    if isinstance(email, str) and email and claims.get("email_verified") is True:
        return email
    return None
