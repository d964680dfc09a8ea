"""Access (admins): console users and their roles, API tokens and gateway keys."""

from __future__ import annotations

import streamlit as st

from console import fmt
from console.client import ROLES, ApiError, ClientError, InvalidRequestError
from console.widgets import client, unreachable

st.title("Access")
st.caption("viewer: health, metrics, events · prompter: and the playground · operator: and settings, restarts, "
           "rollbacks, benchmarks, the audit · admin: and users and tokens.")
try:
    users = client().users()
    tokens = client().tokens()
except ClientError as exc:
    unreachable(exc)

st.subheader("Users")
st.dataframe([{"user": u.username, "role": u.role, "disabled": u.disabled,
               "last sign-in": fmt.clock(u.last_login) if u.last_login else "never",
               "locked until": fmt.clock(u.locked_until) if u.locked_until else ""} for u in users],
             hide_index=True, width="stretch")
LABELS = {"username": "User name", "password": "Password", "role": "Role", "name": "Name",
          "expires_days": "Expires after days", "rate_limit_per_min": "Rate limit"}


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


def clear(*keys: str) -> None:
    for key in keys:
        st.session_state.pop(key, None)


if st.session_state.pop("nu_clear", False):  # a user was created: an empty form for the next one
    clear("nu_name", "nu_password", "nu_role")
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
    new_password = st.text_input("New password (blank: keep)", type="password")
    disabled = st.selectbox("Access", ["(keep)", "enabled", "disabled"])
    if st.form_submit_button("Save"):
        changes = {"role": None if new_role == "(keep)" else new_role, "password": new_password or None,
                   "disabled": None if disabled == "(keep)" else disabled == "disabled"}
        try:
            client().update_user(who, **{k: v for k, v in changes.items() if v is not None})
            st.toast(f"User {who} updated; their sessions ended")
            st.rerun()
        except ApiError as exc:
            st.error(problems(exc, f"change to user {who}"))

st.subheader("Tokens and gateway keys")
st.dataframe([{"id": t.id, "name": t.name, "starts with": t.prefix + "…", "role": t.role,
               "kind": t.kind, "created by": t.created_by, "created": fmt.clock(t.created_at),
               "expires": fmt.clock(t.expires_at) if t.expires_at else "never",
               "rate limit/min": t.rate_limit_per_min, "revoked": fmt.clock(t.revoked_at) if t.revoked_at
               else ""} for t in tokens], hide_index=True, width="stretch")
c1, c2 = st.columns(2)
with c1.form("new_token"):
    st.markdown("**New token**")
    t_name = st.text_input("Name (what it is for)")
    t_role = st.selectbox("Role", ROLES, key="t_role")
    t_kind = st.selectbox("Kind", ["api", "gateway"], help="api: the engine's /api; gateway: an API key for /v1")
    t_days = st.number_input("Expires after days (0: never)", 0.0, 3650.0, 90.0)
    t_rate = st.number_input("Gateway rate limit per minute (0: none)", 0, 1_000_000, 0)
    if st.form_submit_button("Create"):
        try:
            created = client().create_token(t_name, t_role, t_kind, t_days or None, int(t_rate) or None)
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
