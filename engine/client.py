"""Typed httpx client of the engine's API: the only path from the console and the CLI to the engine."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from engine.schemas import (
    ROLES,
    ActionOut,
    AdapterOut,
    AuditOut,
    AuditTallyOut,
    BenchmarkRunOut,
    CapacityOut,
    ChannelOut,
    CompareOut,
    CreatedDeploymentOut,
    DeletionOut,
    DeploymentOut,
    EventOut,
    FiredOut,
    FleetOut,
    GatewayInfo,
    GpuHistoryOut,
    GpuOut,
    KpiRow,
    KpisOut,
    LogsOut,
    MeOut,
    ModelsListOut,
    OkOut,
    Preset,
    PromptOut,
    RevisionOut,
    RuleOut,
    SeriesOut,
    ServingOut,
    SessionOut,
    StatusOut,
    TeamOut,
    TestOut,
    TokenCreatedOut,
    TokenOut,
    UsageOut,
    UserDeletedOut,
    UserOut,
)

DEFAULT_ENGINE_URL = "http://127.0.0.1:8000"
__all__ = [
    "ROLES",
    "ApiError",
    "ClientError",
    "EngineClient",
    "EngineUnreachableError",
    "ForbiddenError",
    "InvalidRequestError",
    "NotFoundError",
    "Run",
    "SettingsRejectedError",
    "StaleRevisionError",
    "UnauthorizedError",
    "route_through",
]
M = TypeVar("M", bound=BaseModel)
_TRANSPORT: httpx.BaseTransport | None = None


def route_through(transport: httpx.BaseTransport | None) -> None:
    """Every client made from now on sends through ``transport`` instead of the network (None: the network again).
    For tests: the console's pages reach an engine app in the same process (tests/console), no engine running."""
    global _TRANSPORT
    _TRANSPORT = transport


class ClientError(Exception):
    """The engine could not do what was asked; the message says what happened."""


class EngineUnreachableError(ClientError):
    pass


class ApiError(ClientError):
    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"engine answered {status}: {detail}")


class InvalidRequestError(ApiError):
    """422: the engine refused the values; each entry of ``fields`` is (field, reason)."""

    @property
    def fields(self) -> list[tuple[str, str]]:
        out = []
        for err in self.detail if isinstance(self.detail, list) else []:
            if not isinstance(err, dict):
                continue
            loc = [str(p) for p in err.get("loc", []) if p not in ("body", "values")]
            fit = err.get("fit")
            hint = " (fits: " + ", ".join(f"{k}={v}" for k, v in fit.items()) + ")" if fit else ""
            out.append((".".join(loc) or "?", str(err.get("msg", "")) + hint))
        return out

    def __str__(self) -> str:
        return "; ".join(f"{f}: {m}" if f != "?" else m for f, m in self.fields) or str(self.detail)


SettingsRejectedError = InvalidRequestError  # what a refused settings write raises


class StaleRevisionError(ApiError):
    pass


class UnauthorizedError(ApiError):
    """401: no token, or it expired or was revoked: sign in again."""


class ForbiddenError(ApiError):
    """403: the token's role may not do this."""


class NotFoundError(ApiError):
    pass


@dataclass
class Run:
    """One playground request and what was measured of it."""

    model: str
    mode: str  # chat | completion
    prompt: str
    system: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, str]] = field(default_factory=list)  # earlier turns of a chat: role and content
    text: str = ""
    ttft_s: float | None = None
    last_token_s: float | None = None  # from the request to its last token
    total_s: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over the generation time: from the request to the last token (prefill included, so a
        burst of tokens that arrive together does not read as thousands per second)."""
        if not self.output_tokens or not self.last_token_s:
            return None
        return self.output_tokens / self.last_token_s

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history + [
            {"role": "user", "content": self.prompt}]


def _error_text(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:300]}"
    err = data.get("error") or data.get("detail") or data
    message = err.get("message") if isinstance(err, dict) else err
    return f"HTTP {resp.status_code}: {message}"


# the API's routes that act on one deployment: /api/<these> on the default one, /api/deployments/{id}/<these> on
# another (engine/api/__init__.py PER_DEPLOYMENT mounts them)
PER_DEPLOYMENT = ("/api/status", "/api/engine/", "/api/gateway", "/api/settings", "/api/capacity", "/api/events",
                  "/api/logs", "/api/serving", "/api/kpis", "/api/benchmarks")


class EngineClient:
    def __init__(self, base_url: str | None = None, *, timeout: float = 10.0, token: str | None = None,
                 deployment: str | int | None = None, headers: dict[str, str] | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        """``token``: a bearer token (a console sign-in's, or one from `llmops token create`); default
        LLMOPS_TOKEN. ``deployment``: the deployment (name or id) the per-deployment calls act on (None: the
        default one). ``headers``: sent with every request (the console's server passes a browser's address).
        ``transport``: how requests reach the engine (default: the network, or what ``route_through`` set)."""
        self.base_url = (base_url or os.environ.get("LLMOPS_ENGINE_URL") or DEFAULT_ENGINE_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("LLMOPS_TOKEN")
        headers = {**(headers or {}), **({"authorization": f"Bearer {self.token}"} if self.token else {})}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers,
                                  transport=transport or _TRANSPORT)
        self._owns_http = True
        self.deployment = deployment

    def of(self, deployment: str | int | None) -> EngineClient:
        """The same client (connection, token) acting on another deployment."""
        other = object.__new__(EngineClient)
        other.base_url, other.token, other._http, other._owns_http = self.base_url, self.token, self._http, False
        other.deployment = deployment
        return other

    def _path(self, path: str) -> str:
        """Where a call goes: a per-deployment route under /api/deployments/{deployment} when one is chosen. A
        name with a / in it cannot be one path segment: such a deployment is addressed by its id."""
        if self.deployment is None or not path.startswith(PER_DEPLOYMENT):
            return path
        segment = str(self.deployment)
        if "/" in segment:
            segment = str(self.deployment_id(segment))
        return f"/api/deployments/{quote(segment, safe='')}{path.removeprefix('/api')}"

    def deployment_id(self, name: str) -> int:
        for row in self.deployments():
            if row.name == name:
                return row.id
        raise NotFoundError(404, f"no deployment {name!r}")

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer of an API call (None when it has no body)."""
        resp = self._send(method, path, **kwargs)
        return resp.json() if resp.content else None

    def _get(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        """An API call's answer as its wire model (engine/schemas)."""
        return model.model_validate(self._request(method, path, **kwargs))

    def _list(self, model: type[M], method: str, path: str, **kwargs: Any) -> list[M]:
        return TypeAdapter(list[model]).validate_python(self._request(method, path, **kwargs))  # type: ignore[valid-type]

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A successful response, or the ClientError that says why there is none."""
        try:
            resp = self._http.request(method, self._path(path), **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnreachableError(
                f"cannot reach the engine at {self.base_url} ({type(exc).__name__}); is `llmops engine` running?"
            ) from exc
        if resp.status_code < 400:
            return resp
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        errors: dict[int, type[ApiError]] = {422: InvalidRequestError, 409: StaleRevisionError, 404: NotFoundError,
                                             401: UnauthorizedError, 403: ForbiddenError}
        raise errors.get(resp.status_code, ApiError)(resp.status_code, detail)

    # --- access ---------------------------------------------------------------------------------------------

    def login(self, username: str, password: str) -> SessionOut:
        """Sign in: a session token (the client uses it from now on), the user's role and its expiry."""
        return self._adopt(self._get(SessionOut, "POST", "/api/auth/login",
                                     json={"username": username, "password": password}))

    def sso_session(self, username: str) -> SessionOut:
        """With the console's service token (admin): a session for a user the identity provider signed in."""
        return self._adopt(self._get(SessionOut, "POST", "/api/auth/sso", json={"username": username}))

    def _adopt(self, session: SessionOut) -> SessionOut:
        """Use a new session's token from now on."""
        self.token = session.token
        self._http.headers["authorization"] = f"Bearer {self.token}"
        return session

    def me(self) -> MeOut:
        """Who this client's token stands for: name, role, kind, and the roles it includes."""
        return self._get(MeOut, "GET", "/api/auth/me")

    def logout(self) -> None:
        self._request("POST", "/api/auth/logout")
        self.token = None
        self._http.headers.pop("authorization", None)

    def users(self) -> list[UserOut]:
        return self._list(UserOut, "GET", "/api/users")

    def create_user(self, username: str, password: str, role: str) -> UserOut:
        return self._get(UserOut, "POST", "/api/users", json={"username": username, "password": password,
                                                              "role": role})

    def update_user(self, username: str, **changes: Any) -> UserOut:
        return self._get(UserOut, "PATCH", f"/api/users/{username}", json=changes)

    def delete_user(self, username: str) -> UserDeletedOut:
        """Delete a user: their sessions, API tokens and gateway keys are revoked with them."""
        return self._get(UserDeletedOut, "DELETE", f"/api/users/{username}")

    def tokens(self) -> list[TokenOut]:
        return self._list(TokenOut, "GET", "/api/tokens")

    def create_token(self, name: str, role: str, kind: str = "api", expires_days: float | None = None,
                     rate_limit_per_min: int | None = None, deployments: list[str] | None = None,
                     **limits: Any) -> TokenCreatedOut:
        """``deployments``: a gateway key limited to these deployments (None: every one); ``limits``: a gateway
        key's team, tokens_per_minute, token_budget, budget_period, weight, and its owner (None: left out)."""
        return self._get(TokenCreatedOut, "POST", "/api/tokens", json={
            "name": name, "role": role, "kind": kind, "expires_days": expires_days,
            "rate_limit_per_min": rate_limit_per_min, "deployments": deployments,
            **{k: v for k, v in limits.items() if v is not None}})

    def update_token(self, token_id: int, **changes: Any) -> TokenOut:
        """A gateway key's team, limits or weight: only the fields given change (None clears a limit)."""
        return self._get(TokenOut, "PATCH", f"/api/tokens/{token_id}", json=changes)

    def teams(self) -> list[TeamOut]:
        return self._list(TeamOut, "GET", "/api/teams")

    def create_team(self, name: str, **limits: Any) -> TeamOut:
        return self._get(TeamOut, "POST", "/api/teams", json={"name": name, **{k: v for k, v in limits.items()
                                                                                if v is not None}})

    def update_team(self, name: str, **changes: Any) -> TeamOut:
        """Only the fields given change (None clears a limit)."""
        return self._get(TeamOut, "PATCH", f"/api/teams/{quote(name, safe='')}", json=changes)

    def delete_team(self, name: str) -> TeamOut:
        return self._get(TeamOut, "DELETE", f"/api/teams/{quote(name, safe='')}")

    def alert_rules(self) -> list[RuleOut]:
        return self._list(RuleOut, "GET", "/api/alerts/rules")

    def create_alert_rule(self, name: str, kind: str, **fields: Any) -> RuleOut:
        return self._get(RuleOut, "POST", "/api/alerts/rules", json={"name": name, "kind": kind, **{
            k: v for k, v in fields.items() if v is not None}})

    def update_alert_rule(self, rule_id: int, **changes: Any) -> RuleOut:
        return self._get(RuleOut, "PATCH", f"/api/alerts/rules/{rule_id}", json=changes)

    def delete_alert_rule(self, rule_id: int) -> RuleOut:
        return self._get(RuleOut, "DELETE", f"/api/alerts/rules/{rule_id}")

    def alert_channels(self) -> list[ChannelOut]:
        return self._list(ChannelOut, "GET", "/api/alerts/channels")

    def create_alert_channel(self, name: str, kind: str, url: str, enabled: bool = True) -> ChannelOut:
        return self._get(ChannelOut, "POST", "/api/alerts/channels", json={"name": name, "kind": kind, "url": url,
                                                                           "enabled": enabled})

    def update_alert_channel(self, channel_id: int, **changes: Any) -> ChannelOut:
        return self._get(ChannelOut, "PATCH", f"/api/alerts/channels/{channel_id}", json=changes)

    def delete_alert_channel(self, channel_id: int) -> ChannelOut:
        return self._get(ChannelOut, "DELETE", f"/api/alerts/channels/{channel_id}")

    def test_alert_channel(self, channel_id: int) -> TestOut:
        """A test message sent to the channel now: what it answered."""
        return self._get(TestOut, "POST", f"/api/alerts/channels/{channel_id}/test")

    def alerts_fired(self, state: str | None = None, limit: int = 200) -> list[FiredOut]:
        return self._list(FiredOut, "GET", "/api/alerts/fired", params={k: v for k, v in {
            "state": state, "limit": limit}.items() if v is not None})

    def usage(self, group_by: str = "key", since: str | None = None, until: str | None = None) -> UsageOut:
        """Requests and tokens per key, team, deployment or day (UTC days, inclusive; default the last 30)."""
        return self._get(UsageOut, "GET", "/api/usage", params={k: v for k, v in {
            "group_by": group_by, "since": since, "until": until}.items() if v is not None})

    def usage_csv(self, group_by: str = "key", since: str | None = None, until: str | None = None) -> bytes:
        return self._send("GET", "/api/usage", params={k: v for k, v in {
            "group_by": group_by, "since": since, "until": until, "format": "csv"}.items() if v is not None}).content

    def revoke_token(self, token_id: int) -> TokenOut:
        return self._get(TokenOut, "DELETE", f"/api/tokens/{token_id}")

    def audit(self, **filters: Any) -> list[AuditOut]:
        return self._list(AuditOut, "GET", "/api/audit", params={k: v for k, v in filters.items() if v is not None})

    def audit_tallies(self, **filters: Any) -> list[AuditTallyOut]:
        """Refused requests without a valid credential, counted per minute, source, action, target and result."""
        return self._list(AuditTallyOut, "GET", "/api/audit/tallies",
                          params={k: v for k, v in filters.items() if v is not None})

    def audit_export(self, fmt: str, **filters: Any) -> bytes:
        params = {"format": fmt, **{k: v for k, v in filters.items() if v is not None}}
        return self._send("GET", "/api/audit/export", params=params).content

    # --- health and status ----------------------------------------------------------------------------------

    def healthz(self) -> bool:
        try:
            return bool(self._request("GET", "/healthz").get("ok"))
        except ClientError:
            return False

    def status(self) -> StatusOut:
        return self._get(StatusOut, "GET", "/api/status")

    # --- deployments ------------------------------------------------------------------------------------------

    def deployments(self) -> list[DeploymentOut]:
        return self._list(DeploymentOut, "GET", "/api/deployments")

    def create_deployment(self, name: str, values: dict[str, Any], *, gpus: list[int] | None = None,
                          enabled: bool = True, note: str = "", force: bool = False) -> CreatedDeploymentOut:
        body = {"name": name, "values": values, "gpus": gpus, "enabled": enabled, "note": note, "force": force}
        return self._get(CreatedDeploymentOut, "POST", "/api/deployments", json=body)

    def update_deployment(self, deployment: str | int, *, enabled: bool | None = None,
                          gpus: list[int] | None = None, any_gpu: bool = False, **prices: float | None
                          ) -> DeploymentOut:
        """``prices``: price_input_per_1k, price_output_per_1k (None clears one; left out: unchanged)."""
        body: dict[str, Any] = {"enabled": enabled, "gpus": gpus, "any_gpu": any_gpu, **prices}
        return self._get(DeploymentOut, "PATCH", f"/api/deployments/{self._segment(deployment)}", json=body)

    def deletion(self, deployment: str | int) -> DeletionOut:
        """What deleting it would remove (for the confirmation)."""
        return self._get(DeletionOut, "GET", f"/api/deployments/{self._segment(deployment)}/deletion")

    def delete_deployment(self, deployment: str | int, confirm: str) -> DeletionOut:
        return self._get(DeletionOut, "DELETE", f"/api/deployments/{self._segment(deployment)}",
                         params={"confirm": confirm})

    def models(self) -> ModelsListOut:
        return self._get(ModelsListOut, "GET", "/api/models")

    def adapters(self, deployment: str | int) -> list[AdapterOut]:
        """The LoRA adapters registered under a deployment, where each is loaded, its last day's requests."""
        return self._list(AdapterOut, "GET", f"/api/deployments/{self._segment(deployment)}/adapters")

    def register_adapter(self, deployment: str | int, name: str, path: str) -> AdapterOut:
        """Check and register a LoRA adapter (a PEFT folder); loaded live on every instance that serves."""
        return self._get(AdapterOut, "POST", f"/api/deployments/{self._segment(deployment)}/adapters",
                         json={"name": name, "path": path})

    def remove_adapter(self, deployment: str | int, name: str) -> OkOut:
        return self._get(OkOut, "DELETE", f"/api/deployments/{self._segment(deployment)}/adapters/"
                         f"{quote(name, safe='')}")

    def fleet(self) -> FleetOut:
        """Nodes → GPUs (or the host) → instances."""
        return self._get(FleetOut, "GET", "/api/fleet")

    def _segment(self, deployment: str | int) -> str:
        text = str(deployment)
        return quote(str(self.deployment_id(text)) if "/" in text else text, safe="")

    def wait_for(self, states: set[str], timeout: float, revision: int | None = None,
                 poll: float = 0.5, on_status: Callable[[StatusOut], None] | None = None) -> StatusOut:
        """Poll until the engine is in one of ``states`` (and runs ``revision``, if given), or TimeoutError;
        ``on_status`` sees each status read on the way (the CLI prints the start's phases from it)."""
        deadline = time.monotonic() + timeout
        last: StatusOut | None = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
            except EngineUnreachableError:
                last = None
            if last is not None and on_status is not None:
                on_status(last)
            if last and last.state in states and (revision is None or last.running_revision == revision):
                return last
            time.sleep(poll)
        where = f"{last.state} ({last.reason})" if last else "unreachable"
        raise TimeoutError(f"engine not in {sorted(states)} after {timeout:.0f} s; it is {where}")

    # --- settings -------------------------------------------------------------------------------------------

    def settings(self) -> RevisionOut:
        return self._get(RevisionOut, "GET", "/api/settings")

    def settings_schema(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/api/settings/schema")
        return result

    def revision(self, revision: int) -> RevisionOut:
        return self._get(RevisionOut, "GET", f"/api/settings/{revision}")

    def history(self, limit: int = 50) -> list[RevisionOut]:
        return self._list(RevisionOut, "GET", "/api/settings/history", params={"limit": limit})

    def put_settings(self, base_revision: int, values: dict[str, Any], note: str = "",
                     force: bool = False) -> RevisionOut:
        body = {"base_revision": base_revision, "values": values, "note": note, "force": force}
        return self._get(RevisionOut, "PUT", "/api/settings", json=body)

    def capacity(self, values: dict[str, Any]) -> CapacityOut:
        """Pre-flight and capacity prediction for values not saved yet."""
        params = {k: ("" if v is None else str(v).lower() if isinstance(v, bool) else v) for k, v in values.items()}
        return self._get(CapacityOut, "GET", "/api/capacity", params=params)

    def rollback(self, revision: int, note: str = "", force: bool = False) -> RevisionOut:
        body = {"revision": revision, "note": note, "force": force}
        return self._get(RevisionOut, "POST", "/api/settings/rollback", json=body)

    # --- engine actions, events, logs -----------------------------------------------------------------------

    def engine_action(self, action: str) -> ActionOut:
        return self._get(ActionOut, "POST", f"/api/engine/{action}")

    def events(self, since: int = 0, limit: int = 200, kinds: list[str] | None = None,
               newest_first: bool = False) -> list[EventOut]:
        params: dict[str, Any] = {"since": since, "limit": limit, "newest_first": newest_first}
        if kinds:
            params["kind"] = kinds
        return self._list(EventOut, "GET", "/api/events", params=params)

    def logs(self, tail: int = 200, *, hide_polling: bool = False, level: str = "debug",
             contains: str | None = None) -> list[str]:
        """The last ``tail`` lines of vLLM's log that pass the filters (level and above, text, no polling)."""
        params: dict[str, Any] = {"tail": tail, "hide_polling": hide_polling, "level": level}
        if contains:
            params["contains"] = contains
        return self._get(LogsOut, "GET", "/api/logs", params=params).lines

    def logs_download(self) -> bytes:
        return self._send("GET", "/api/logs/download").content

    # --- GPU health and serving -----------------------------------------------------------------------------

    def gpu(self) -> GpuOut:
        return self._get(GpuOut, "GET", "/api/gpu")

    def gpu_history(self, window: str, devices: list[int] | None = None,
                    metrics: list[str] | None = None) -> GpuHistoryOut:
        params: dict[str, Any] = {"window": window}
        if devices:
            params["device"] = devices
        if metrics:
            params["metric"] = metrics
        return self._get(GpuHistoryOut, "GET", "/api/gpu/history", params=params)

    def gateway(self) -> GatewayInfo:
        """How clients reach the served model: /v1 base URL, whether keys are needed, the model's card."""
        return self._get(GatewayInfo, "GET", "/api/gateway")

    def serving(self) -> ServingOut:
        return self._get(ServingOut, "GET", "/api/serving")

    def serving_history(self, window: str, metrics: list[str] | None = None) -> SeriesOut:
        params: dict[str, Any] = {"window": window}
        if metrics:
            params["metric"] = metrics
        return self._get(SeriesOut, "GET", "/api/serving/history", params=params)

    def instance_history(self, window: str, metrics: list[str] | None = None) -> SeriesOut:
        """Each instance of the deployment over time (requests routed, share by prefix, prefix-cache hits, KV use),
        one series per instance name."""
        params: dict[str, Any] = {"window": window}
        if metrics:
            params["metric"] = metrics
        return self._get(SeriesOut, "GET", "/api/serving/instances/history", params=params)

    def scaling_history(self, window: str) -> SeriesOut:
        """The deployment's replicas serving and wanted, and its load, over time (one series)."""
        return self._get(SeriesOut, "GET", "/api/serving/scaling/history", params={"window": window})

    def kpis(self, window: str, revision: int | None = None, client: str | None = None) -> list[KpiRow]:
        params: dict[str, Any] = {"window": window}
        if revision is not None:
            params["revision"] = revision
        if client is not None:
            params["client"] = client
        return self._get(KpisOut, "GET", "/api/kpis", params=params).revisions

    # --- benchmarks -----------------------------------------------------------------------------------------

    def benchmarks(self, revision: int | None = None) -> list[BenchmarkRunOut]:
        params = {"revision": revision} if revision is not None else {}
        return self._list(BenchmarkRunOut, "GET", "/api/benchmarks", params=params)

    def benchmark(self, run_id: int) -> BenchmarkRunOut:
        return self._get(BenchmarkRunOut, "GET", f"/api/benchmarks/{run_id}")

    def start_sweep(self, preset: str, concurrency: list[int], num_prompts: int | None = None,
                    seed: int | None = None) -> BenchmarkRunOut:
        """A sweep; ``seed`` sends the same prompts at every level on purpose (a prefix-cache test)."""
        return self._get(BenchmarkRunOut, "POST", "/api/benchmarks", json={
            "preset": preset, "concurrency": concurrency, "num_prompts": num_prompts, "seed": seed})

    def start_search(self, preset: str, target_p95_s: float, candidates: list[int],
                     num_prompts: int | None = None) -> BenchmarkRunOut:
        return self._get(BenchmarkRunOut, "POST", "/api/benchmarks/search", json={
            "preset": preset, "target_p95_s": target_p95_s, "candidates": candidates, "num_prompts": num_prompts})

    def cancel_benchmark(self, run_id: int) -> BenchmarkRunOut:
        return self._get(BenchmarkRunOut, "POST", f"/api/benchmarks/{run_id}/cancel")

    def compare_benchmarks(self, a: int, b: int) -> CompareOut:
        return self._get(CompareOut, "GET", "/api/benchmarks/compare", params={"a": a, "b": b})

    def presets(self) -> dict[str, Preset]:
        return TypeAdapter(dict[str, Preset]).validate_python(self._request("GET", "/api/benchmarks/presets"))

    # --- playground -----------------------------------------------------------------------------------------

    def prompts(self, limit: int = 50, before: int | None = None) -> list[PromptOut]:
        """A page of saved prompts, newest first (``before``: the last id of the previous page)."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        return self._list(PromptOut, "GET", "/api/prompts", params=params)

    def save_prompt(self, name: str, mode: str, system: str, prompt: str, params: dict[str, Any]) -> PromptOut:
        return self._get(PromptOut, "POST", "/api/prompts", json={
            "name": name, "mode": mode, "system": system, "prompt": prompt, "params": params})

    def delete_prompt(self, prompt_id: int) -> None:
        self._request("DELETE", f"/api/prompts/{prompt_id}")

    def stream(self, run: Run) -> Iterator[str]:
        """Send ``run`` through the engine's /v1 gateway and yield text as it streams; ``run`` collects the
        time to first token, token counts, tokens/s and the finish reason."""
        body: dict[str, Any] = {"model": run.model, "stream": True, "stream_options": {"include_usage": True},
                                **{k: v for k, v in run.params.items() if v not in (None, "", [])}}
        if run.mode == "chat":
            path = "/v1/chat/completions"
            body["messages"] = run.messages()
        else:
            path = "/v1/completions"
            body["prompt"] = run.prompt
        t0 = time.perf_counter()
        try:
            with self._http.stream("POST", path, json=body, timeout=httpx.Timeout(600.0, connect=10.0)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    run.error = _error_text(resp)
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        run.error = str(chunk["error"].get("message", chunk["error"]))
                        return
                    if chunk.get("usage"):
                        run.input_tokens = chunk["usage"].get("prompt_tokens")
                        run.output_tokens = chunk["usage"].get("completion_tokens")
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") if run.mode == "chat" else choice.get("text")
                        if choice.get("finish_reason"):
                            run.finish_reason = choice["finish_reason"]
                        if text:
                            run.last_token_s = time.perf_counter() - t0
                            if run.ttft_s is None:
                                run.ttft_s = run.last_token_s
                            run.text += text
                            yield text
        except httpx.TransportError as exc:
            run.error = f"the engine stopped answering ({type(exc).__name__})"
        finally:
            run.total_s = time.perf_counter() - t0
            run.done = True
