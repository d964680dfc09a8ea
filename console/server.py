"""The console's web server: Streamlit (console/app.py) plus a sign-in that survives reloads and deep links.

A sign-in posts to ``/signin`` on this server, which asks the engine for a session and keeps the engine's session
token in an HttpOnly, SameSite=Strict cookie: the browser sends it with every request and the websocket, and no
page script can read it. Each Streamlit session reads it from the request (``st.context.cookies``); the engine
stays the authority (it checks the token on every call, and a sign-out, expiry or revocation ends it there).
A page request without a valid session is sent to ``/signin?next=<the page>``, and comes back to it.

A sign-in or sign-out is refused unless it was posted by a page of this console (Origin, else Referer: another site
must not sign a browser in as its own user, login CSRF); ``/signout`` takes POST only. The engine is told the
browser's address with the console's key (LLMOPS_CONSOLE_KEY_FILE, which `llmops up` and `llmops console` hand
over), so its audit shows who signed in from where, not the console's address.

Run: ``python -m console.serve`` (``llmops console`` does: uvicorn with engine/edge.py's bounded, timed heads and
Host check in front); ``streamlit run console/server.py`` or another ASGI server on ``console.server:app`` lack them.
"""

from __future__ import annotations

import contextlib
import html
import os
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, quote, urlencode, urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run` puts console/ on the path, not the project root
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402
from starlette.concurrency import run_in_threadpool  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import HTMLResponse, RedirectResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.types import ASGIApp, Receive, Scope, Send  # noqa: E402

from console import drafts  # noqa: E402
from console.session import COOKIE, safe_next  # noqa: E402
from engine.client import ApiError, ClientError, EngineClient  # noqa: E402
from engine.schemas import CONSOLE_CLIENT_HEADER, CONSOLE_KEY_HEADER  # noqa: E402

# Paths Streamlit serves for itself (assets, websocket, its own auth) and ours: never sent to the sign-in.
OPEN_PREFIXES = ("/_stcore/", "/static/", "/component/", "/media/", "/app/static/", "/auth/", "/oauth2callback",
                 "/signin", "/signout", "/favicon")
FORM_LIMIT = 8192  # bytes of a sign-in form
FORM_FIELDS = 8  # fields a sign-in form may have (it has three)


def _browser(request: Request) -> dict[str, str]:
    """Headers that tell the engine this browser's address, vouched for by the console's key (none without it)."""
    key_file = os.environ.get("LLMOPS_CONSOLE_KEY_FILE")
    if not key_file or request.client is None:
        return {}
    try:
        key = Path(key_file).read_text().strip()
    except OSError:  # the engine runs elsewhere, or as another user: its audit shows the console's address
        return {}
    return {CONSOLE_KEY_HEADER: key, CONSOLE_CLIENT_HEADER: request.client.host} if key else {}


def _engine(token: str | None = None, request: Request | None = None) -> EngineClient:
    return EngineClient(os.environ.get("LLMOPS_ENGINE_URL"), timeout=10.0, token=token or "",
                        headers=_browser(request) if request is not None else None)


def _same_origin(request: Request) -> bool:
    """Whether a POST came from a page of this console: its Origin (else its Referer) names this host, and the
    browser does not say it came from another site. Neither header: refused (every browser sends one)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        return False
    # this console as the browser addressed it (a proxy in front may pass that on as X-Forwarded-Host; another
    # site's form cannot add a header, so believing it opens nothing)
    hosts = {h.strip().lower() for h in (request.headers.get("host", ""),
                                         *request.headers.get("x-forwarded-host", "").split(",")) if h.strip()}
    for name in ("origin", "referer"):
        value = request.headers.get(name)
        if value:
            return value != "null" and urlsplit(value).netloc.lower() in hosts
    return False


def _revoke(token: str, request: Request) -> None:
    """End a session at the engine; an expired or revoked one, or an engine that is down, leaves nothing to do."""
    with contextlib.suppress(ClientError), _engine(token, request) as engine:
        engine.logout()


def _valid(token: str) -> bool | None:
    """True: the engine knows the session; False: it does not; None: the engine cannot be reached."""
    try:
        with _engine(token) as engine:
            engine.me()
    except ApiError as exc:
        return False if exc.status == 401 else None
    except ClientError:
        return None
    return True


def _sso_configured() -> bool:
    return (ROOT / ".streamlit" / "secrets.toml").exists() or Path(".streamlit/secrets.toml").exists()


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sign in · llmops console</title>
<style>
:root {{ color-scheme: light dark; --bg: #ffffff; --fg: #31333f; --muted: #6b6f80; --line: #d5d7de;
        --accent: #ff4b4b; --err: #7d1a1a; --errbg: #ffe5e5; }}
@media (prefers-color-scheme: dark) {{ :root {{ --bg: #0e1117; --fg: #fafafa; --muted: #a3a8b8; --line: #3b3f4b;
        --errbg: #3e1d1d; --err: #ffb3b3; }} }}
body {{ margin: 0; background: var(--bg); color: var(--fg); font: 16px/1.5 system-ui, -apple-system, "Segoe UI",
       Roboto, sans-serif; }}
main {{ max-width: 24rem; margin: 12vh auto; padding: 0 1.5rem; }}
h1 {{ font-size: 2rem; margin: 0 0 .25rem; }}
p.caption {{ color: var(--muted); font-size: .9rem; margin: 0 0 1.5rem; }}
label {{ display: block; font-size: .9rem; margin: 1rem 0 .3rem; }}
input {{ width: 100%; box-sizing: border-box; padding: .55rem .7rem; font: inherit; color: inherit;
        background: transparent; border: 1px solid var(--line); border-radius: .5rem; }}
input:focus {{ outline: 2px solid var(--accent); outline-offset: -1px; }}
button, a.button {{ margin-top: 1.4rem; padding: .55rem 1.1rem; font: inherit; color: #fff; background: var(--accent);
        border: 0; border-radius: .5rem; cursor: pointer; text-decoration: none; display: inline-block; }}
a.button {{ background: transparent; color: var(--fg); border: 1px solid var(--line); }}
.error {{ margin-top: 1rem; padding: .7rem .9rem; border-radius: .5rem; background: var(--errbg); color: var(--err); }}
.note {{ margin-top: 1rem; color: var(--muted); font-size: .9rem; }}
</style></head>
<body><main>
<h1>Sign in</h1>
<p class="caption">llmops console: operations for a vLLM server. Ask an admin for an account.</p>
<form method="post" action="{action}">
<input type="hidden" name="next" value="{next}">
<label for="username">User</label>
<input id="username" name="username" autocomplete="username" value="{username}" required maxlength="64" autofocus>
<label for="password">Password</label>
<input id="password" name="password" type="password" autocomplete="current-password" required maxlength="1024">
<button type="submit">Sign in</button>
</form>
{message}{sso}
</main></body></html>
"""


def _page(next_url: str, *, username: str = "", error: str | None = None, note: str | None = None,
          status: int = 200) -> HTMLResponse:
    message = f'<div class="error" role="alert">{html.escape(error)}</div>' if error else ""
    if note:
        message += f'<p class="note">{html.escape(note)}</p>'
    sso = ('<p class="note">Or use your organisation\'s sign-in:</p>'
           f'<a class="button" href="/?sso=1&amp;next={quote(next_url)}">Sign in with single sign-on</a>'
           if _sso_configured() else "")
    body = PAGE.format(action="/signin", next=html.escape(next_url), username=html.escape(username),
                       message=message, sso=sso)
    return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store"})


async def signin(request: Request) -> Response:
    next_url = safe_next(request.query_params.get("next"))
    if request.method == "GET":
        note = {"out": "You are signed out.", "expired": "Your sign-in has expired or was revoked: sign in again."}
        response: Response = _page(next_url, note=note.get(request.query_params.get("why") or ""))
        if token := request.cookies.get(COOKIE):  # a new sign-in starts here: the old session ends at the engine
            await run_in_threadpool(_revoke, token, request)
            response.delete_cookie(COOKIE, path="/")
        return response
    if not _same_origin(request):
        return _page(next_url, error="Sign-in refused: the form was not sent from this console's own page (another "
                     "site cannot sign you in). Open the console's address and sign in there.", status=403)
    response = await _signin_post(request, next_url)
    if token := request.cookies.get(COOKIE):  # the session the browser held ends, whether this one began or not
        # (a failed sign-in left the previous user signed in; a new one left the old session alive at the engine)
        await run_in_threadpool(_revoke, token, request)
        if response.status_code != 303:
            response.delete_cookie(COOKIE, path="/")
    return response


async def _signin_post(request: Request, next_url: str) -> Response:
    """The posted form checked and sent to the engine: a redirect with the new session's cookie, or the form again
    saying why not."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > FORM_LIMIT:
            return _page(next_url, error="The sign-in form was too large.", status=413)
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=FORM_FIELDS)
    except ValueError:  # more fields than the form has
        return _page(next_url, error="The sign-in form held more fields than it has: reload the page and sign in "
                     "again.", status=400)
    form = {k: v[0] for k, v in fields.items()}
    username, password = form.get("username", "")[:64], form.get("password", "")[:1024]
    next_url = safe_next(form.get("next"))
    try:
        session = await run_in_threadpool(lambda: _engine(request=request).login(username, password))
    except ApiError as exc:
        message = ("Locked out for a while after repeated failures." if exc.status == 423
                   else "Unknown user or wrong password." if exc.status in (401, 422) else str(exc))
        return _page(next_url, username=username, error=message, status=exc.status if exc.status < 500 else 502)
    except ClientError as exc:
        return _page(next_url, username=username, error=str(exc), status=502)
    response = RedirectResponse(next_url, status_code=303)
    max_age = max(1, int(session.expires_at - time.time())) if session.expires_at else None
    response.set_cookie(COOKIE, session.token, max_age=max_age, path="/", httponly=True, samesite="strict",
                        secure=_https(request))
    return response


async def signout(request: Request) -> Response:
    """POST only, from a page of this console (the sidebar's *Sign out*): the session ends at the engine and the
    cookie goes, whether or not the engine still knew the session."""
    if request.method != "POST":  # answered here: Streamlit's own routes would serve the app for a GET
        return Response("Sign out with the console's Sign out button (POST /signout).", status_code=405,
                        headers={"Allow": "POST"})
    if not _same_origin(request):
        return _page("/", error="Sign-out refused: it was not sent from this console's own page.", status=403)
    if token := request.cookies.get(COOKIE):
        await run_in_threadpool(_revoke, token, request)
        drafts.forget(token)  # the next user of this browser starts from nothing
    response = RedirectResponse("/signin?" + urlencode({"why": "out"}), status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


def _https(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"


class RequireSignIn:
    """Sends a page request (HTML) without a valid session to the sign-in page, which brings it back here after."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD") or \
                scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if "text/html" not in request.headers.get("accept", "") or request.query_params.get("sso") == "1" or \
                "_streamlit_user" in request.cookies:
            await self.app(scope, receive, send)
            return
        token = request.cookies.get(COOKIE)
        valid = await run_in_threadpool(_valid, token) if token else False
        if valid is False:  # None: the engine is down; the page says so itself
            target = scope["path"] + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
            query = {"next": safe_next(target), **({"why": "expired"} if token else {})}
            await RedirectResponse("/signin?" + urlencode(query), status_code=303)(scope, receive, send)
            return
        await self.app(scope, receive, send)


ROUTES = [Route("/signin", signin, methods=["GET", "POST"]), Route("/signout", signout, methods=["GET", "POST"])]
app = st.App(Path(__file__).resolve().parent / "app.py", routes=ROUTES, middleware=[Middleware(RequireSignIn)])
