"""Access (admins): console users and their roles, API tokens and gateway keys."""

from __future__ import annotations

import streamlit as st

from console import fmt
from console.widgets import client, unreachable
from engine.client import ROLES, ApiError, ClientError, InvalidRequestError

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
    if st.form_submit_button("Save"):
        changes = {"role": None if new_role == "(keep)" else new_role, "password": new_password or None,
                   "disabled": None if disabled == "(keep)" else disabled == "disabled"}
        try:
            client().update_user(who, **{k: v for k, v in changes.items() if v is not None})
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

st.subheader("Tokens and gateway keys")
st.dataframe([{"id": t.id, "name": t.name, "starts with": t.prefix + "…", "role": t.role,
               "kind": t.kind, "owner": t.owner or "—", "created by": t.created_by,
               "created": fmt.clock(t.created_at),
               "expires": fmt.clock(t.expires_at) if t.expires_at else "never",
               "rate limit/min": t.rate_limit_per_min, "state": t.state,
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
