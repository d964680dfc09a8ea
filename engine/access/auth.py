"""Who may do what: local users (argon2 password hashes), bearer tokens (stored as SHA-256 digests), sessions that
expire, lockout after repeated failures, and the role each route needs.

Roles, each including the ones before it: ``viewer`` (health, metrics, events), ``prompter`` (and the
playground), ``operator`` (and settings, restarts, rollbacks, benchmarks), ``admin`` (and users, tokens).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, col, delete, func, select

from engine.access.hashing import HashPool
from engine.db import ApiToken, Database, LoginFailure, User, unavailable_reason
from engine.errors import EngineError
from engine.schemas import ROLES, TokenState, check_name

TOKEN_PREFIX = "llmops_"
log = logging.getLogger("llmops.auth")

USERNAME = re.compile(r"[A-Za-z0-9_.@+][A-Za-z0-9_.@+-]{0,63}")  # fullmatch: "admin\n" is not "admin"
UNKNOWN_KEPT = 10_000  # unknown user names whose failed sign-ins are counted (table login_failure)


# Characters that read alike in the fonts names are shown in (UTS #39's confusables, ASCII part), compared after
# case folding: "adm1n", "admln" and "ADMIN" all read as "admin".
LOOKALIKE = (("rn", "m"), ("vv", "w"), ("cl", "d"), ("0", "o"), ("1", "l"), ("i", "l"), ("|", "l"))


def skeleton(name: str) -> str:
    """What a name looks like: two names with one skeleton are easily taken for each other."""
    text = name.casefold()
    for seen, like in LOOKALIKE:
        text = text.replace(seen, like)
    return text


def token_state(row: ApiToken, now: float | None = None) -> TokenState:
    """active, expired or revoked."""
    if row.revoked_at:
        return "revoked"
    if row.expires_at and row.expires_at < (time.time() if now is None else now):
        return "expired"
    return "active"


def allows(role: str, needed: str) -> bool:
    return role in ROLES and needed in ROLES and ROLES.index(role) >= ROLES.index(needed)


class AuthError(EngineError):
    """Authentication or authorisation failed."""


class BadCredentialsError(AuthError):
    pass


class UnknownUserError(AuthError):
    pass


class OwnerGoneError(AuthError):
    """The user a new token would belong to is disabled or deleted."""


class LastAdminError(AuthError):
    """The change would leave no enabled admin."""


SSO_MINTED = "sso:"  # a session's created_by when single sign-on opened it: sso:<the credential's token id>
SSO_MINTED_BY = re.compile(r"sso:(\d{1,18})")


class LockedError(AuthError):
    def __init__(self, until: float) -> None:
        self.until = until
        super().__init__(f"too many failed sign-ins: locked for {max(0, until - time.time()):.0f} s more")


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    kind: str
    token_id: int | None = None
    rate_limit_per_min: int | None = None
    user_id: int | None = None  # the user who owns the token (None: made on the engine's machine by the CLI)
    deployments: tuple[str, ...] | None = None  # a gateway key's deployments (None: every one)

    def may_use(self, deployment: str | None) -> bool:
        """Whether this caller may send requests to ``deployment`` (a name) through the gateway."""
        return self.deployments is None or (deployment is not None and deployment in self.deployments)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Auth:
    def __init__(self, db: Database, session_ttl_s: float = 12 * 3600, max_failures: int = 5,
                 lockout_s: float = 900, hash_workers: int = 2, hash_queue: int = 16,
                 hash_per_source: int | None = None) -> None:
        self.db = db
        # every argon2 hash runs there, never on the API's threads
        self.pool = HashPool(hash_workers, hash_queue, hash_per_source)
        self.session_ttl_s = session_ttl_s
        self.max_failures = max_failures
        self.lockout_s = lockout_s
        self.hasher = PasswordHasher()
        self._last_used: dict[int, float] = {}
        # tokens' last uses not yet written, and the one thread that writes them (off the request's path: a request
        # never waits for the database's write lock to record its token's use)
        self._uses: dict[int, float] = {}
        self._uses_lock = threading.Lock()
        self._use_writer: threading.Thread | None = None
        # A name that is no user fails and locks like one that is: same answer, same time, same lockout, and
        # the same after a restart (its failures are in the database, table login_failure, bounded).
        self._dummy_hash = self.hasher.hash(secrets.token_urlsafe(16))
        self.changes = 0  # counts revocations and user changes: caches of authenticate() start over

    # --- users ----------------------------------------------------------------------------------------------

    def users(self) -> Sequence[User]:
        with self.db.read() as s:
            return s.exec(select(User).order_by(col(User.id))).all()

    def has_users(self) -> bool:
        with self.db.read() as s:
            return s.exec(select(User.id).limit(1)).first() is not None

    def create_user(self, username: str, password: str, role: str) -> User:
        if not USERNAME.fullmatch(username):
            raise AuthError("username: use 1-64 letters, digits and . _ @ + -, not starting with -")
        if role not in ROLES:
            raise AuthError(f"role: one of {', '.join(ROLES)}")
        if len(password) < 10:
            raise AuthError("password: at least 10 characters")
        with self.db.session() as s:
            self._name_free(s, username)
        password_hash = self.pool.call(self.hasher.hash, password)
        with self.db.session() as s:
            self._name_free(s, username)  # taken while the password was hashed?
            # a new id above any a token names as its owner: a deleted user's revoked tokens never seem another's
            taken = max(s.exec(select(func.max(User.id))).one() or 0,
                        s.exec(select(func.max(ApiToken.user_id))).one() or 0)
            user = User(id=taken + 1, username=username, password_hash=password_hash, role=role)
            s.add(user)
            s.flush()
            return user

    @staticmethod
    def _name_free(s: Session, username: str) -> None:
        """Refuse a name that is, ignoring case, or looks like, an existing user's (``Admin`` beside ``admin``,
        ``adm1n``): the console, the audit and a person reading them must not take one user for another."""
        for (existing,) in s.execute(select(User.username)).all():
            if existing.casefold() == username.casefold():
                raise AuthError(f"user {existing!r} exists (user names are the same whatever their case)")
            if skeleton(existing) == skeleton(username):
                raise AuthError(f"username: {username!r} looks like the existing user {existing!r}; choose a name "
                                "that cannot be taken for it")

    def update_user(self, username: str, *, role: str | None = None, password: str | None = None,
                    disabled: bool | None = None) -> tuple[User, int]:
        """Change a user; returns the user and how many of their tokens and keys were revoked. Disabling or
        demoting a user revokes every token and key they own (made by them, or by a token of theirs); a new
        password ends their sessions. The last enabled admin can be neither disabled nor demoted."""
        if password is not None and len(password) < 10:
            raise AuthError("password: at least 10 characters")
        if role is not None and role not in ROLES:
            raise AuthError(f"role: one of {', '.join(ROLES)}")
        password_hash = self.pool.call(self.hasher.hash, password) if password is not None else None
        with self.db.session() as s:
            user = s.exec(select(User).where(User.username == username)).first()
            if user is None:
                raise UnknownUserError(f"no user {username!r}")
            demoted = role is not None and not allows(role, user.role)
            if (demoted or (disabled and not user.disabled)) and self._last_admin(s, user):
                raise LastAdminError(f"{username} is the last enabled admin: make another user admin first "
                                     "(nobody could manage users and tokens otherwise)")
            if role is not None:
                user.role = role
            if password_hash is not None:
                user.password_hash = password_hash
                user.failed_attempts, user.locked_until = 0, None
            if disabled is not None:
                user.disabled = disabled
            s.add(user)
            revoked = 0
            if disabled or demoted:  # what they hold stops at once: sessions, API tokens, gateway keys
                revoked = self._revoke_owned(s, user, kinds=None)
            elif role is not None or password is not None:  # their sessions end
                revoked = self._revoke_owned(s, user, kinds=("session",))
        self.changes += 1  # after the commit: a cache refilled before it would keep the old answer
        return user, revoked

    def delete_user(self, username: str) -> tuple[User, int]:
        """Delete a user and revoke every session, token and key they own; returns the user as it was and how
        many were revoked. The last enabled admin cannot be deleted. Their audit records stay."""
        with self.db.session() as s:
            user = s.exec(select(User).where(User.username == username)).first()
            if user is None:
                raise UnknownUserError(f"no user {username!r}")
            if not user.disabled and self._last_admin(s, user):
                raise LastAdminError(f"{username} is the last enabled admin: make another user admin first "
                                     "(nobody could manage users and tokens otherwise)")
            revoked = self._revoke_owned(s, user, kinds=None)
            s.delete(user)
        self.changes += 1
        return user, revoked

    @staticmethod
    def _last_admin(s: Session, user: User) -> bool:
        """Whether ``user`` is the only enabled admin (inside the caller's transaction, which holds the write
        lock: two admins cannot demote each other at once)."""
        if user.role != "admin" or user.disabled:
            return False
        others = s.exec(select(User.id).where(User.role == "admin", col(User.disabled).is_(False),
                                              User.id != user.id).limit(1)).first()
        return others is None

    @staticmethod
    def _revoke_owned(s: Session, user: User, kinds: tuple[str, ...] | None) -> int:
        q = select(ApiToken).where(ApiToken.user_id == user.id, col(ApiToken.revoked_at).is_(None))
        if kinds is not None:
            q = q.where(col(ApiToken.kind).in_(kinds))
        now = time.time()
        rows = s.exec(q).all()
        for tok in rows:
            tok.revoked_at = now
            s.add(tok)
        return len([t for t in rows if t.kind != "session"])

    def ensure_admin(self, password: str | None) -> str | None:
        """On an empty user table create ``admin``; return the generated password (None if given or existing)."""
        if self.has_users():
            return None
        generated = None if password else secrets.token_urlsafe(12)
        self.create_user("admin", password or generated or "", "admin")
        return generated

    def _verify(self, password_hash: str, password: str) -> bool:
        try:  # argon2 takes tens of milliseconds: never while holding the database's write lock
            return bool(self.hasher.verify(password_hash, password))
        except (VerificationError, InvalidHashError):
            return False

    def _unknown_locked_until(self, username: str) -> float:
        with self.db.session() as s:
            row = s.get(LoginFailure, username)
            return row.locked_until if row is not None else 0.0

    def _unknown_failure(self, username: str, now: float) -> None:
        """Count a failed sign-in of a name that is no user, with the lockout a user would get, in the database
        (a restart must not tell users from non-users); at most UNKNOWN_KEPT names, unlocked and oldest dropped
        first."""
        with self.db.session() as s:
            row = s.get(LoginFailure, username)
            if row is None:
                row = LoginFailure(name=username)
                excess = s.exec(select(func.count()).select_from(LoginFailure)).one() + 1 - UNKNOWN_KEPT
                if excess > 0:
                    drop = select(LoginFailure.name).order_by(col(LoginFailure.locked_until),
                                                              col(LoginFailure.updated_at)).limit(excess)
                    s.execute(delete(LoginFailure).where(col(LoginFailure.name).in_(drop)))
            if row.locked_until and row.locked_until <= now:
                row.failures, row.locked_until = 0, 0.0
            row.failures += 1
            if row.failures >= self.max_failures:
                row.failures, row.locked_until = 0, now + self.lockout_s
            row.updated_at = now
            s.add(row)

    async def login_async(self, username: str, password: str, source: str = "") -> tuple[str, ApiToken, User]:
        """``login`` on a hashing thread: HashBusyError at once when too many sign-ins wait already, or too many of
        ``source``'s."""
        return await self.pool.run(self.login, username, password, source=source)

    def login(self, username: str, password: str) -> tuple[str, ApiToken, User]:
        """A new session token for the user, or BadCredentialsError / LockedError. Whether the user exists, is
        disabled or is locked, the same argon2 work is done and the same answers come back: neither the time nor
        the message tells an attacker which names are users."""
        now = time.time()
        with self.db.session() as s:
            found = s.exec(select(User).where(User.username == username)).first()
        if found is None or found.disabled:
            self._verify(self._dummy_hash, password)
            until = self._unknown_locked_until(username)
            if until > now:
                raise LockedError(until)
            self._unknown_failure(username, now)
            raise BadCredentialsError("unknown user or wrong password")
        ok = self._verify(found.password_hash, password)
        if found.locked_until and found.locked_until > now:
            raise LockedError(found.locked_until)
        locked_until: float | None = None
        with self.db.session() as s:
            user = s.exec(select(User).where(User.username == username)).first()
            if user is None or user.disabled:  # deleted or disabled while the password was checked
                raise BadCredentialsError("unknown user or wrong password")
            if user.locked_until and user.locked_until > now:  # a parallel attempt locked it while we verified
                locked_until = user.locked_until
            elif not ok:  # counted and committed before refusing
                user.failed_attempts += 1
                if user.failed_attempts >= self.max_failures:
                    user.locked_until, user.failed_attempts = now + self.lockout_s, 0
            else:
                user.failed_attempts, user.locked_until, user.last_login = 0, None, now
                token, row = self._new_token(s, name=f"session {username}", role=user.role, kind="session",
                                             user_id=user.id, created_by=username, ttl_s=self.session_ttl_s)
            s.add(user)
        if locked_until is not None:
            raise LockedError(locked_until)
        if not ok:
            raise BadCredentialsError("unknown user or wrong password")
        return token, row, user

    def session_for(self, username: str, minted_by: Principal) -> tuple[str, ApiToken, User]:
        """A session for an existing, enabled, not locked-out user whom an identity provider has signed in (no
        password), opened by the console's single sign-on credential ``minted_by`` (a token of kind sso). The
        session names it (``created_by`` sso:<its id>) and ends when it is revoked or expires."""
        if minted_by.kind != "sso" or minted_by.token_id is None:
            raise AuthError("only the console's single sign-on credential (a token of kind sso) opens sessions for "
                            "others")
        with self.db.session() as s:
            user = s.exec(select(User).where(User.username == username)).first()
            if user is None or user.disabled:
                raise AuthError(f"no enabled user {username!r}: an admin creates users and gives them a role")
            if user.locked_until is not None and user.locked_until > time.time():
                raise LockedError(user.locked_until)
            user.last_login = time.time()
            s.add(user)
            token, row = self._new_token(s, name=f"session {username} (sso via {minted_by.name})"[:100],
                                         role=user.role, kind="session", user_id=user.id,
                                         created_by=f"{SSO_MINTED}{minted_by.token_id}", ttl_s=self.session_ttl_s)
            return token, row, user

    # --- tokens ---------------------------------------------------------------------------------------------

    def _new_token(self, s: Session, *, name: str, role: str, kind: str, user_id: int | None, created_by: str,
                   ttl_s: float | None, rate_limit_per_min: int | None = None,
                   deployments: list[str] | None = None, limits: dict[str, Any] | None = None
                   ) -> tuple[str, ApiToken]:
        if role not in ROLES:
            raise AuthError(f"role: one of {', '.join(ROLES)}")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        row = ApiToken(name=name, digest=digest(token), prefix=token[:12], role=role, kind=kind, user_id=user_id,
                       created_by=created_by, expires_at=time.time() + ttl_s if ttl_s else None,
                       rate_limit_per_min=rate_limit_per_min, deployments=deployments, **(limits or {}))
        s.add(row)
        s.flush()
        return token, row

    def create_token(self, name: str, role: str, kind: str = "api", created_by: str = "",
                     ttl_s: float | None = None, rate_limit_per_min: int | None = None,
                     owner_id: int | None = None, deployments: list[str] | None = None,
                     limits: dict[str, Any] | None = None) -> tuple[str, ApiToken]:
        """A new token; the returned string is its only copy. ``owner_id``: the user it belongs to (the one who
        made it, or the owner of the token that made it): disabling, demoting or deleting them revokes it.
        ``deployments``: a gateway key limited to these deployments (by name; None: every one); ``limits``: a
        gateway key's team_id, tokens_per_minute, token_budget, budget_period and weight."""
        if kind not in ("api", "gateway", "sso"):
            raise AuthError("kind: api, gateway or sso")
        if kind == "sso" and role != "viewer":
            raise AuthError("role: a single sign-on credential (kind sso) is a viewer: it opens sessions and does "
                            "nothing else")
        if deployments is not None and kind != "gateway":
            raise AuthError("deployments: only a gateway key is limited to deployments")
        if limits and kind != "gateway":
            raise AuthError(f"{next(iter(limits))}: only a gateway key has a team and token limits")
        try:
            check_name(name)
        except ValueError as exc:
            raise AuthError(f"name: {exc}") from None
        with self.db.session() as s:
            if owner_id is not None:
                owner = s.get(User, owner_id)
                if owner is None or owner.disabled:  # disabled while their request was on its way
                    raise OwnerGoneError("the token's owner is disabled or deleted")
            return self._new_token(s, name=name, role=role, kind=kind, user_id=owner_id, created_by=created_by,
                                   ttl_s=ttl_s, rate_limit_per_min=rate_limit_per_min, deployments=deployments,
                                   limits=limits)

    def tokens(self) -> Sequence[ApiToken]:
        """API tokens and gateway keys (console sessions are not listed)."""
        with self.db.read() as s:
            return s.exec(select(ApiToken).where(ApiToken.kind != "session").order_by(col(ApiToken.id))).all()

    def revoke(self, token_id: int | None = None, token: str | None = None, name: str | None = None) -> ApiToken:
        with self.db.session() as s:
            q = select(ApiToken)
            if token_id is not None:
                q = q.where(ApiToken.id == token_id)
            elif token is not None:
                q = q.where(ApiToken.digest == digest(token))
            else:
                q = q.where(ApiToken.name == name, col(ApiToken.revoked_at).is_(None))
            row = s.exec(q).first()
            if row is None:
                raise AuthError("no such token")
            row.revoked_at = row.revoked_at or time.time()
            s.add(row)
        self.changes += 1
        return row

    def _record_use(self, token_id: int, at: float) -> None:
        """A token's last use, written by one thread of its own: the request that used it goes on at once."""
        with self._uses_lock:
            self._uses[token_id] = at
            if self._use_writer is not None:  # (it takes this one too before it ends)
                return
            writer = threading.Thread(target=self._write_uses, name="llmops-token-uses", daemon=True)
            writer.start()
            self._use_writer = writer

    def flush_uses(self, timeout_s: float) -> bool:
        """At shutdown: wait up to ``timeout_s`` for the tokens' last uses to be written (False: some are not)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._uses_lock:
                writer = self._use_writer
            if writer is None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            writer.join(left)  # (a writer may hand over to another as it ends: looked at again)

    def _write_uses(self) -> None:
        try:
            while True:
                with self._uses_lock:
                    uses, self._uses = self._uses, {}
                if not uses:
                    return
                try:
                    with self.db.session() as s:
                        for token_id, at in uses.items():
                            row = s.get(ApiToken, token_id)
                            if row is not None and (row.last_used_at or 0) < at:
                                row.last_used_at = at
                                s.add(row)
                except SQLAlchemyError as exc:  # unavailable, read-only, …: tried again at a use a minute on
                    log.warning("%d tokens' last use could not be recorded (%s): it will be at their next use "
                                "after a minute", len(uses), unavailable_reason(exc))
                    return
        finally:
            with self._uses_lock:
                self._use_writer = None
                if self._uses:  # came while it ended: another writer takes them
                    writer = threading.Thread(target=self._write_uses, name="llmops-token-uses", daemon=True)
                    writer.start()
                    self._use_writer = writer

    def authenticate(self, token: str) -> Principal | None:
        """The principal a bearer token stands for, or None (unknown, revoked, expired, or its user disabled)."""
        if not token.startswith(TOKEN_PREFIX):
            return None
        now = time.time()
        with self.db.read() as s:  # no lock: a request is not held behind the database's writers
            row = s.exec(select(ApiToken).where(ApiToken.digest == digest(token))).first()
            if row is None or row.revoked_at or (row.expires_at and row.expires_at < now):
                return None
            name, role = row.name, row.role
            if row.kind == "session" and (minted := SSO_MINTED_BY.fullmatch(row.created_by)):
                # a session opened by single sign-on lives as long as the credential that opened it: revoked or
                # expired, its sessions end with it (a user name cannot hold ':', so no sign-in's looks like this)
                minter = s.get(ApiToken, int(minted[1]))
                if minter is None or minter.revoked_at or (minter.expires_at and minter.expires_at < now):
                    return None
            if row.user_id is not None:
                user = s.get(User, row.user_id)
                if user is None or user.disabled:
                    return None
                if row.kind == "session":
                    name = user.username
                if not allows(user.role, role):
                    role = user.role  # never more than its owner may do now
        assert row.id is not None
        if now - self._last_used.get(row.id, 0) > 60:  # record use at most once a minute
            self._last_used[row.id] = now
            self._record_use(row.id, now)
        return Principal(name=name, role=role, kind=row.kind, token_id=row.id,
                         rate_limit_per_min=row.rate_limit_per_min, user_id=row.user_id,
                         deployments=tuple(row.deployments) if row.deployments is not None else None)
