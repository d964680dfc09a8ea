"""Access (admins): console users and their roles, teams and their limits, API tokens and gateway keys."""

from __future__ import annotations

from typing import Any

import streamlit as st

from console import fmt
from console.usage import budget_text as usage_text
from console.widgets import client, unreachable
from engine.client import ROLES, ApiError, ClientError, InvalidRequestError

st.title("Access")
st.caption("viewer: health, metrics, events · prompter: and the playground · operator: and settings, restarts, "
           "rollbacks, benchmarks, the audit · admin: and users and tokens.")
try:
    users = client().users()
    tokens = client().tokens()
    teams = client().teams()
except ClientError as exc:
    unreachable(exc)
TEAM_NAMES = [t.name for t in teams]

st.subheader("Users")
st.dataframe([{"user": u.username, "role": u.role, "team": u.team or "—", "disabled": u.disabled,
               "last sign-in": fmt.clock(u.last_login) if u.last_login else "never",
               "locked until": fmt.clock(u.locked_until) if u.locked_until else ""} for u in users],
             hide_index=True, width="stretch")
LABELS = {"username": "User name", "password": "Password", "role": "Role", "name": "Name",
          "expires_days": "Expires after days", "rate_limit_per_min": "Requests per minute",
          "tokens_per_minute": "Tokens per minute", "token_budget": "Token budget", "budget_period": "Budget period",
          "weight": "Weight", "team": "Team", "owner": "Owner"}


def problems(exc: ApiError, about: str) -> str:
    """What the engine refused, in the words of the form: "User name: use 1-64 letters…"."""
    if isinstance(exc, InvalidRequestError) and exc.fields:
        lines = []
        for field, reason in exc.fields:
            name, _, rest = reason.partition(": ")
            if field == "?" and name in LABELS:  # the engine's own checks say "username: ..."
                field, reason = name, rest
            lines.append(f"**{LABELS.get(field, field)}**: {reason}")
        return f"The {about} was not saved.  \n" + "  \n".join(lines)
    return f"The {about} was not saved: {exc.detail if isinstance(exc.detail, str) else exc}"


if st.session_state.pop("nu_clear", False):  # a user was created: an empty form for the next one
    # set, not removed: a removed key resets the widget on the server only, and the browser kept showing (and
    # sending back) the created user's password
    st.session_state.update(nu_name="", nu_password="", nu_role=ROLES[0])
if st.session_state.pop("eu_clear", False):  # a user was changed: no new password left in the form
    st.session_state["eu_password"] = ""
c1, c2 = st.columns(2)
with c1.form("new_user"):  # not cleared on submit: a refused form keeps what was typed
    st.markdown("**New user**")
    name = st.text_input("User name", key="nu_name")
    password = st.text_input("Initial password (10+ characters)", type="password", key="nu_password")
    role = st.selectbox("Role", ROLES, key="nu_role")
    if st.form_submit_button("Create"):
        try:
            client().create_user(name, password, role)
        except ApiError as exc:
            st.error(problems(exc, "user"))
        else:
            st.toast(f"User {name} created")
            st.session_state["nu_clear"] = True
            st.rerun()
with c2.form("edit_user"):
    st.markdown("**Change a user**")
    who = st.selectbox("User", [u.username for u in users]) or ""
    new_role = st.selectbox("Role", ["(keep)", *ROLES])
    new_password = st.text_input("New password (blank: keep)", type="password", key="eu_password")
    disabled = st.selectbox("Access", ["(keep)", "enabled", "disabled"])
    new_team = st.selectbox("Team", ["(keep)", "(none)", *TEAM_NAMES], help="they see its usage")
    if st.form_submit_button("Save"):
        changes = {"role": None if new_role == "(keep)" else new_role, "password": new_password or None,
                   "disabled": None if disabled == "(keep)" else disabled == "disabled"}
        sent: dict[str, object] = {k: v for k, v in changes.items() if v is not None}
        if new_team != "(keep)":
            sent["team"] = None if new_team == "(none)" else new_team
        try:
            client().update_user(who, **sent)
        except ApiError as exc:
            st.error(problems(exc, f"change to user {who}"))
        else:
            before = next((u for u in users if u.username == who), None)
            lowered = before is not None and changes["role"] is not None and \
                ROLES.index(changes["role"]) < ROLES.index(before.role)
            st.toast(f"User {who} updated; their sessions, API tokens and gateway keys were revoked"
                     if changes["disabled"] or lowered else f"User {who} updated; their sessions ended"
                     if changes["role"] or changes["password"] else f"User {who} updated")
            st.session_state["eu_clear"] = True
            st.rerun()


@st.dialog("Delete this user?")
def confirm_delete(name: str) -> None:
    owned = [t for t in tokens if t.owner == name and not t.revoked_at]
    st.markdown(f"**{name}** is deleted: they can no longer sign in, their console sessions end at once, and "
                + (f"these **{len(owned)}** API tokens and gateway keys of theirs are revoked:" if owned else
                   "they own no active API token or gateway key.")
                + " Their records in the audit stay. This cannot be undone.")
    if owned:
        st.dataframe([{"id": t.id, "name": t.name, "kind": t.kind, "role": t.role} for t in owned],
                     hide_index=True)
    if st.button(f"Delete {name}", type="primary"):
        try:
            done = client().delete_user(name)
        except ApiError as exc:
            st.error(f"{name} was not deleted: {exc.detail if isinstance(exc.detail, str) else exc}")
            return
        st.session_state["deleted_user"] = f"User {done.username} deleted; {done.tokens_revoked} token(s) revoked"
        st.rerun()


if done_text := st.session_state.pop("deleted_user", None):
    st.toast(done_text)
    st.session_state["del_user"] = None  # the deleted name is no longer a choice
with st.container(horizontal=True, vertical_alignment="bottom"):
    doomed = st.selectbox("Delete a user", [u.username for u in users], index=None, key="del_user",
                          placeholder="Choose a user")
    if st.button("Delete…", disabled=doomed is None, icon=":material/person_remove:") and doomed:
        confirm_delete(doomed)

st.subheader("Teams")
st.caption("A team's limits hold for all its keys together (each key's own too); its weight is its share of a "
           "deployment at capacity against the others waiting. Usage is billed by team on the Usage page.")
st.dataframe([{"team": t.name, "weight": t.weight, "keys": t.keys, "members": ", ".join(t.members) or "—",
               "requests/min": t.rate_limit_per_min, "tokens/min": t.tokens_per_minute,
               "budget": f"{t.token_budget:,} a {t.budget_period}" if t.token_budget else "—",
               "used": usage_text(t.budget) if t.budget else "—", "note": t.note} for t in teams],
             hide_index=True, width="stretch")


def limit_inputs(prefix: str, current: object = None) -> dict[str, Any]:
    """The limit fields of a form (0: none), filled with ``current``'s (a team or a key) when given."""
    def now(field: str) -> int:
        value = getattr(current, field, None)
        return int(value) if isinstance(value, int) else 0
    c = [*st.columns(2), *st.columns(2)]  # two by two: four across cramps the labels in a half-width form
    rpm = c[0].number_input("Requests per minute (0: none)", 0, 1_000_000, now("rate_limit_per_min"),
                            key=f"{prefix}_rpm")
    tpm = c[1].number_input("Tokens per minute (0: none)", 0, 10**12, now("tokens_per_minute"), key=f"{prefix}_tpm",
                            help="prompt and completion; a request reserves its prompt and max_tokens until it ends")
    budget = c[2].number_input("Token budget (0: none)", 0, 10**15, now("token_budget"), key=f"{prefix}_budget")
    periods = ["day", "month"]
    period = c[3].selectbox("Budget period (UTC)", periods, key=f"{prefix}_period",
                            index=periods.index(str(getattr(current, "budget_period", None) or "day")))
    weight = st.number_input("Weight in fair queues", 0.01, 1000.0, float(getattr(current, "weight", 1.0) or 1.0),
                             key=f"{prefix}_weight", help="2 gets twice the slots of 1 when a deployment is full")
    return {"rate_limit_per_min": int(rpm) or None, "tokens_per_minute": int(tpm) or None,
            "token_budget": int(budget) or None, "budget_period": period if budget else None, "weight": weight}


t1, t2 = st.columns(2)
with t1.form("new_team"):
    st.markdown("**New team**")
    team_name = st.text_input("Name", key="team_name")
    team_note = st.text_input("Note", key="team_note")
    team_limits = limit_inputs("nt")
    if st.form_submit_button("Create team"):
        try:
            client().create_team(team_name, note=team_note, **team_limits)
        except ApiError as exc:
            st.error(problems(exc, "team"))
        else:
            st.session_state["team_done"] = f"Team {team_name} created"
            st.rerun()
with t2:
    chosen_team = st.selectbox("Change a team", teams, format_func=lambda t: t.name, index=None, key="team_pick",
                               placeholder="Choose a team")
    if chosen_team is not None:
        with st.form("edit_team"):
            edited = limit_inputs(f"et_{chosen_team.name}", chosen_team)
            c_save, c_delete = st.columns(2)
            if c_save.form_submit_button("Save limits"):
                try:
                    client().update_team(chosen_team.name, **edited)
                except ApiError as exc:
                    st.error(problems(exc, f"change to team {chosen_team.name}"))
                else:
                    st.session_state["team_done"] = f"Team {chosen_team.name} updated"
                    st.rerun()
            if c_delete.form_submit_button("Delete team", help="its keys and members belong to no team after; each "
                                           "key keeps its own limits"):
                client().delete_team(chosen_team.name)
                st.session_state["team_done"] = f"Team {chosen_team.name} deleted"
                st.session_state["team_pick"] = None
                st.rerun()
if done_team := st.session_state.pop("team_done", None):
    st.toast(done_team)

st.subheader("Tokens and gateway keys")
st.dataframe([{"id": t.id, "name": t.name, "starts with": t.prefix + "…", "role": t.role,
               "kind": t.kind, "owner": t.owner or "—", "team": t.team or "—", "created by": t.created_by,
               "created": fmt.clock(t.created_at),
               "expires": fmt.clock(t.expires_at) if t.expires_at else "never",
               "requests/min": t.rate_limit_per_min, "tokens/min": t.tokens_per_minute,
               "budget": f"{t.token_budget:,} a {t.budget_period}" if t.token_budget else "—",
               "used": usage_text(t.budget) if t.budget else "—", "weight": t.weight, "state": t.state,
               "revoked": fmt.clock(t.revoked_at) if t.revoked_at else ""} for t in tokens],
             hide_index=True, width="stretch")
c1, c2 = st.columns(2)
with c1.form("new_token"):
    st.markdown("**New token**")
    t_name = st.text_input("Name (what it is for)")
    t_role = st.selectbox("Role", ROLES, key="t_role")
    t_kind = st.selectbox("Kind", ["api", "gateway", "sso"],
                          help="api: the engine's /api; gateway: an API key for /v1; sso: the console's single "
                          "sign-on credential (LLMOPS_CONSOLE_TOKEN), a viewer that opens sessions and does nothing "
                          "else")
    t_days = st.number_input("Expires after days (0: never)", 0.0, 3650.0, 90.0)
    st.caption("Gateway keys only:")
    t_team = st.selectbox("Team", ["(none)", *TEAM_NAMES], key="t_team")
    t_owner = st.selectbox("Owner (sees its usage)", ["(me)", *[u.username for u in users if not u.disabled]],
                           key="t_owner")
    t_limits = limit_inputs("nk")
    if st.form_submit_button("Create"):
        extra: dict[str, Any] = {k: v for k, v in t_limits.items() if k != "rate_limit_per_min"} \
            if t_kind == "gateway" else {}
        if t_kind == "gateway" and extra.get("weight") == 1.0:
            extra.pop("weight")
        try:
            created = client().create_token(
                t_name, t_role, t_kind, t_days or None, t_limits["rate_limit_per_min"],
                team=None if t_team == "(none)" else t_team, owner=None if t_owner == "(me)" else t_owner, **extra)
        except ApiError as exc:
            st.error(problems(exc, "token"))
        else:
            st.session_state["created_token"] = created.token  # not "new_token": that is the form's key
if token := st.session_state.pop("created_token", None):
    st.success("Copy it now: it is shown this once.")
    st.code(token, language=None)
with c2.form("revoke"):
    st.markdown("**Revoke a token**")
    active = [t for t in tokens if not t.revoked_at]
    which = st.selectbox("Token", active, format_func=lambda t: f"#{t.id} {t.name} ({t.prefix}…)")
    if st.form_submit_button("Revoke") and which:
        client().revoke_token(which.id)
        st.toast(f"Token {which.id} revoked")
        st.rerun()


gateway_keys = [t for t in tokens if t.kind == "gateway" and t.state == "active"]
if gateway_keys:
    st.markdown("**Change a gateway key's team and limits**")
    key_pick = st.selectbox("Gateway key", gateway_keys, format_func=lambda t: f"#{t.id} {t.name} ({t.prefix}…)",
                            key="key_pick")
    if key_pick is not None:
        with st.form("edit_key"):
            k_team = st.selectbox("Team", ["(none)", *TEAM_NAMES], key=f"ek_team_{key_pick.id}",
                                  index=(TEAM_NAMES.index(key_pick.team) + 1) if key_pick.team in TEAM_NAMES else 0)
            k_limits = limit_inputs(f"ek_{key_pick.id}", key_pick)
            if st.form_submit_button("Save key"):
                try:
                    client().update_token(key_pick.id, team=None if k_team == "(none)" else k_team, **k_limits)
                except ApiError as exc:
                    st.error(problems(exc, f"change to key {key_pick.name}"))
                else:
                    st.session_state["key_done"] = f"Key {key_pick.name} updated"
                    st.rerun()
if done_key := st.session_state.pop("key_done", None):
    st.toast(done_key)
