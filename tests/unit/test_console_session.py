"""The console's sign-in redirects: back to a page of this console, never to another site."""

from __future__ import annotations

import pytest

from console.session import safe_next


@pytest.mark.parametrize("target", ["/settings", "/events?x=1", "/"])
def test_a_page_of_the_console_is_kept(target: str) -> None:
    assert safe_next(target) == target


@pytest.mark.parametrize("target", [None, "", "https://evil.example/", "//evil.example/x", "/\\evil.example",
                                    "javascript:alert(1)", "/a\r\nSet-Cookie: x=1", "/signin?next=/x", "/signout"])
def test_anything_else_goes_to_the_overview(target: str | None) -> None:
    assert safe_next(target) == "/"
