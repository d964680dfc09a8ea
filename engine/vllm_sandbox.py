"""The filesystem sandbox of every vLLM server the engine starts (issue 31, item 7).

vLLM runs a model's code (its remote code too, when an admin allows it) as the engine's own user, and the engine's
secrets lie beside it in the data dir: the database (password hashes, token digests, the audit), ``run/cli.token``
(an admin token), ``run/console.key``, the logs. The engine therefore starts vLLM as

    python -m engine.vllm_sandbox --hide DATA_DIR --keep DATA_DIR/models --read ENGINE ... -- python -m vllm...

and this module confines itself with Linux Landlock, then execs vLLM; every process vLLM forks inherits it. What
is hidden cannot be opened at all (read, written, executed); what is read-only can be read and run, not changed
(the engine's own code, so that vLLM cannot plant code the engine would run at its next start).

Landlock only allows: whatever no rule covers is refused. So ``plan`` walks from ``/`` down to each named path
and, at each folder on the way, gives every other entry the access it has (a folder: beneath it; a file: the file
alone), never the named path's own. The folders on the way can only be listed: nothing new can be made in them
(vLLM's temporary files go elsewhere when the temp folder is one of them: engine/vllm/command.py sandbox_for).

Run by the engine's Python (or a Ray node's) in vLLM's environment: the standard library and engine.errors only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

from engine.errors import SandboxUnavailableError

MODULE = "engine.vllm_sandbox"

# --- Landlock's kernel interface (include/uapi/linux/landlock.h); these syscall numbers are every arch's but alpha's

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3 and 5
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # all a rule on a file (not a folder) may hold
READ_RIGHTS = EXECUTE | READ_FILE | READ_DIR

Level = Literal["none", "read", "all"]  # what a named path and everything beneath it may be: hidden, read-only, all
Access = Literal["all", "read", "list"]  # a rule: all; read and execute; or (a folder on the way) list its names


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]  # the first field is all the kernel requires


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def handled_rights(abi: int) -> int:
    """The filesystem rights Landlock ABI ``abi`` knows (all are handled: one not handled is never refused)."""
    rights = (1 << 13) - 1  # ABI 1: EXECUTE … MAKE_SYM
    if abi >= 2:
        rights |= REFER  # links and renames across folders (without it, ABI 1 refuses them all)
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def _syscall(number: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = int(libc.syscall(ctypes.c_long(number), *args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def abi_version() -> int:
    """The Landlock ABI of this kernel; SandboxUnavailableError, saying why, where there is none."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(f"Landlock is Linux's; this is {sys.platform}")
    try:
        return _syscall(SYS_CREATE_RULESET, ctypes.c_void_p(None), ctypes.c_size_t(0),
                        ctypes.c_uint32(CREATE_RULESET_VERSION))
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            raise SandboxUnavailableError("this kernel has no Landlock (it needs Linux 5.13 or later, built with "
                                          "CONFIG_SECURITY_LANDLOCK)") from None
        if exc.errno == errno.EOPNOTSUPP:
            raise SandboxUnavailableError("Landlock is turned off on this host (add landlock to the kernel's lsm= "
                                          "boot parameter)") from None
        raise SandboxUnavailableError(f"Landlock could not be used ({exc.strerror}; a container's seccomp filter "
                                      "may refuse its system calls)") from None


def boot_id() -> str | None:
    """This host's boot id: what tells the engine's host from another (a Ray node) without a name to trust."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


# --- the plan: which rules make the named paths what they are named -----------------------------------------------


@dataclass(frozen=True)
class Rule:
    path: str
    access: Access


def _under(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or beneath it (both real and absolute)."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


class _Named:
    """The named paths (real, existing) and their levels: a path's level is that of the deepest named path at or
    above it (none named: all). The same path named twice keeps the stricter level."""

    def __init__(self, hide: Iterable[str], read: Iterable[str], keep: Iterable[str]) -> None:
        self.levels: dict[str, Level] = {}
        stricter: tuple[tuple[Iterable[str], Level], ...] = ((keep, "all"), (read, "read"), (hide, "none"))
        for paths, level in stricter:
            for path in paths:
                real = os.path.realpath(path)
                if os.path.lexists(real):  # what is not there (another host's paths) has nothing to hide
                    self.levels[real] = level

    def level(self, path: str) -> Level:
        while path not in self.levels:
            if path == "/":
                return "all"
            path = os.path.dirname(path)
        return self.levels[path]

    def split(self, path: str) -> bool:
        """Whether some named path beneath ``path`` has another level than ``path``: it is a folder on the way."""
        mine = self.level(path)
        return any(p != path and _under(p, path) and level != mine for p, level in self.levels.items())

    def below(self, folder: str) -> set[str]:
        """The entries of ``folder`` on the way to a named path (what the walk needs where it cannot list)."""
        prefix = folder.rstrip("/") + "/"
        return {p[len(prefix):].split("/", 1)[0] for p in self.levels if p.startswith(prefix)}


def plan(hide: Iterable[str], read: Iterable[str] = (), keep: Iterable[str] = ()) -> list[Rule]:
    """The Landlock rules that hide ``hide``, make ``read`` read-only and leave everything else (``keep`` too,
    beneath a hidden or read-only folder) as it is. Paths are taken as they really are (links resolved); one that
    does not exist is left out (nothing to hide)."""
    named = _Named(hide, read, keep)
    rules: list[Rule] = []
    if named.split("/"):
        _walk("/", named, rules)
    elif (level := named.level("/")) != "none":
        rules.append(Rule("/", level))
    return rules


def _walk(folder: str, named: _Named, rules: list[Rule]) -> None:
    rules.append(Rule(folder, "list"))
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # a folder the user cannot list: only the way through it is known
        names = sorted(named.below(folder))
    for name in names:
        path = os.path.join(folder, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:  # gone meanwhile
            continue
        if stat.S_ISLNK(mode):  # a link leads to a place of its own, which has its own rule
            continue
        if stat.S_ISDIR(mode) and named.split(path):
            _walk(path, named, rules)
        elif (level := named.level(path)) != "none":
            rules.append(Rule(path, level))


def rights(access: Access, is_dir: bool, handled: int) -> int:
    """What a rule allows: beneath a folder, or on a file alone (a file's rule may hold file rights only)."""
    if access == "all":
        wanted = handled
    elif access == "read":
        wanted = READ_RIGHTS
    else:
        wanted = READ_DIR
    return wanted & handled & (~0 if is_dir else FILE_RIGHTS)


def restrict(rules: Sequence[Rule]) -> int:
    """Confine this process (and all it execs and forks from now on) to ``rules``; the Landlock ABI used.
    SandboxUnavailableError where Landlock is missing; OSError where a rule is refused."""
    abi = abi_version()
    handled = handled_rights(abi)
    attr = _RulesetAttr(handled)
    ruleset = _syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                       ctypes.c_uint32(0))
    try:
        for rule in rules:
            try:
                fd = os.open(rule.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # gone since the plan: nothing to allow
                continue
            try:
                mode = os.fstat(fd).st_mode
                allowed = 0 if stat.S_ISLNK(mode) else rights(rule.access, stat.S_ISDIR(mode), handled)
                if allowed:
                    beneath = _PathBeneathAttr(allowed, fd)
                    _syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                             ctypes.byref(beneath), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        _no_new_privs()
        _syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return abi


def _no_new_privs() -> None:
    """Landlock asks for it (without CAP_SYS_ADMIN): nothing vLLM execs gains privileges (setuid) from now on."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


# --- the wrapper: the engine's side builds its command line, vLLM's side runs it --------------------------------


@dataclass(frozen=True)
class Sandbox:
    """What a vLLM child may not open (``hide``), may only read (``read``), and keeps beneath those (``keep``);
    ``host``: the boot id of the engine's host (on another, a Ray node's, nothing of the engine's is there)."""

    hide: tuple[str, ...]
    read: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    host: str | None = None

    def plan(self) -> list[Rule]:
        return plan(self.hide, self.read, self.keep)

    def can_make_in(self, folder: str) -> bool:
        """Whether vLLM can make new entries in ``folder``: not if it is hidden or read-only, nor on the way to a
        path named here (a folder on the way can only be listed)."""
        named, real = _Named(self.hide, self.read, self.keep), os.path.realpath(folder)
        return named.level(real) == "all" and not named.split(real)

    def keeping(self, *paths: str) -> Sandbox:
        return Sandbox(self.hide, self.read, (*self.keep, *paths), self.host)

    def wrap(self, args: Sequence[str], python: str = sys.executable) -> list[str]:
        """``args`` run inside this sandbox (``python`` runs this module, which then execs ``args``). A leading
        ``nice -n N`` (engine/vllm/command.py at_nice) goes first, so that the wrapper's own start already runs at
        the priority the child is given (it ran at the engine's, hundreds of milliseconds on a busy host)."""
        opts = [*(x for p in self.hide for x in ("--hide", p)), *(x for p in self.read for x in ("--read", p)),
                *(x for p in self.keep for x in ("--keep", p)), *(("--host", self.host) if self.host else ())]
        lead = list(args[:3]) if len(args) > 3 and os.path.basename(args[0]) == "nice" and args[1] == "-n" else []
        return [*lead, python, "-m", MODULE, *opts, "--", *args[len(lead):]]


def parse(argv: Sequence[str]) -> tuple[Sandbox, list[str]]:
    """The wrapper's command line: ``--hide P``, ``--read P``, ``--keep P`` (each repeated), ``--host ID``, then
    ``--`` and the command to exec. ValueError when it is not that."""
    if "--" not in argv:
        raise ValueError("no command: -- COMMAND ... ends the options")
    split = list(argv).index("--")
    options, command = list(argv[:split]), list(argv[split + 1:])
    if not command:
        raise ValueError("no command after --")
    named: dict[str, list[str]] = {"--hide": [], "--read": [], "--keep": [], "--host": []}
    if len(options) % 2:
        raise ValueError(f"an option without its value: {options[-1]}")
    for flag, value in zip(options[::2], options[1::2], strict=True):
        if flag not in named:
            raise ValueError(f"unknown option {flag}")
        named[flag].append(value)
    host = named["--host"][-1] if named["--host"] else None
    return Sandbox(tuple(named["--hide"]), tuple(named["--read"]), tuple(named["--keep"]), host), command


EXIT_USAGE, EXIT_UNCONFINED, EXIT_NOT_FOUND = 2, 71, 127


def _outermost(paths: Sequence[str]) -> list[str]:
    """``paths`` less those beneath another of them (what the log says)."""
    return [p for p in paths if not any(q != p and _under(p, q) for q in paths)]


def main(argv: Sequence[str]) -> NoReturn:
    try:
        sandbox, command = parse(argv)
    except ValueError as exc:
        print(f"llmops sandbox: {exc}\nusage: python -m {MODULE} [--hide P] [--read P] [--keep P] [--host ID] -- "
              "COMMAND ...", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    if sandbox.host is not None and sandbox.host != boot_id():
        print("llmops sandbox: not the engine's host: nothing of the engine's is here to hide", flush=True)
        for name in ("TMPDIR", "VLLM_RPC_BASE_PATH"):  # the engine's own folders for vLLM's files and sockets
            if not os.path.isdir(os.environ.get(name) or "/"):
                os.environ.pop(name)
    else:
        rules = sandbox.plan()
        try:
            abi = restrict(rules)
        except (SandboxUnavailableError, OSError) as exc:  # never run vLLM unconfined when it was meant to be
            print(f"llmops sandbox: vLLM was not started, it could not be confined: {exc}. To start it unconfined "
                  "set vllm_sandbox to false (LLMOPS_VLLM_SANDBOX=false)", file=sys.stderr, flush=True)
            sys.exit(EXIT_UNCONFINED)
        print(f"llmops sandbox: hidden {', '.join(_outermost(sandbox.hide))} but {', '.join(sandbox.keep) or '-'}; "
              f"read-only {', '.join(sandbox.read) or '-'} ({len(rules)} Landlock rules, ABI {abi})", flush=True)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"llmops sandbox: cannot run {command[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        sys.exit(EXIT_NOT_FOUND)


if __name__ == "__main__":
    main(sys.argv[1:])
