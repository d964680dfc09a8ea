"""vLLM's output: a rotating file under the data dir, the recent lines in memory, and the filters of its tail."""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# a secret in a logged line: a query parameter that names one, a bearer credential, one of our tokens
_SECRET = re.compile(r"(?P<keep>[?&](?:api[_-]?key|access[_-]?token|token|key|password|secret|sig)=)[^&\s\"']+"
                     r"|(?P<bearer>[Bb]earer\s+)[^\s\"',]+|llmops_[A-Za-z0-9_-]{16,}", re.I)


def redact_secrets(line: str) -> str:
    """The line with query-string secrets, bearer credentials and llmops tokens replaced by [redacted]."""
    if "=" not in line and "earer" not in line and "llmops_" not in line:
        return line
    return _SECRET.sub(lambda m: (m["keep"] or m["bearer"] or "") + "[redacted]", line)


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log file that is the engine's alone (mode 0600) and is opened again when someone deletes or
    moves it (a plain handler keeps writing into the deleted inode, and the log is gone for good)."""

    def _open(self):  # type: ignore[no-untyped-def]  # logging's own signature
        os.makedirs(os.path.dirname(self.baseFilename), mode=0o700, exist_ok=True)  # its folder went too
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        st = os.fstat(fd)
        self._ident = (st.st_dev, st.st_ino)
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is not None:
            try:
                st = os.stat(self.baseFilename)
                moved = (st.st_dev, st.st_ino) != self._ident
            except FileNotFoundError:
                moved = True
            if moved:
                self.stream.close()
                self.stream = None  # reopened below by logging
        super().emit(record)

    _ident: tuple[int, int] = (-1, -1)


class ChildLog:
    """vLLM's output: a rotating file under the data dir plus the recent lines in memory, secrets redacted."""

    def __init__(self, path: Path, max_bytes: int, backups: int, keep_lines: int = 5000) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handler = PrivateRotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger = logging.Logger(f"llmops.vllm.{id(self)}")
        self._logger.addHandler(self._handler)
        self._logger.propagate = False
        self.lines: deque[str] = deque(maxlen=keep_lines)

    def new_run(self, banner: str) -> None:
        self.mark(banner)

    def mark(self, what: str) -> None:
        """One of the engine's own lines (a run begins, an instance is stopped on purpose or exits on its own):
        what the log's classifier (classify) reads planned stops and failures from."""
        self.write(f"{MARK}{what} =====")

    def write(self, line: str) -> None:
        line = redact_secrets(line)
        self.lines.append(line)
        self._logger.info(line)

    def tail(self, n: int) -> list[str]:
        if n <= 0:
            return []
        return list(self.lines)[-n:]

    def close(self) -> None:
        self._handler.close()


POLLING = re.compile(r'"(?:GET|HEAD) /(?:health|metrics|ping|load)(?:\?\S*)? HTTP/')
LEVELS = {"debug": 0, "info": 1, "warning": 2, "error": 3}
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
MARK = "===== llmops: "  # the engine's own lines in vLLM's log (ChildLog.mark)
_INSTANCE = re.compile(r"\[([A-Za-z0-9_-]{1,32})\] ")  # each vLLM line is marked with its instance
_RUN = re.compile(r"===== llmops: instance (\S+), revision ")
_STOPPING = re.compile(r"===== llmops: stopping instance (\S+) ")
# vLLM shutting down because it was asked to (SIGTERM from the engine, or anyone): what follows, tracebacks of
# its output handler included, is the shutdown of a planned stop, not a failure
_SHUTDOWN = re.compile(r"\[shutdown\]|received signal=SIGTERM|^INFO: +Shutting down")
# an untagged line that says something failed: an exception, pydantic's "Value error, ...", an OOM
_FAILURE = re.compile(r"^\S*(?:Error|Exception)\b.*:|^\s*Value error, |out of memory|\bOOM\b")
# the leak reports every vLLM process prints at exit (nanobind, multiprocessing's resource tracker)
_NOISE = re.compile(r"nanobind: |^\s*- leaked |^\s*- \.\.\. skipped remainder|refleaks\.html|"
                    r"resource_tracker: There appear to be|warnings\.warn\('resource_tracker")


@dataclass
class _Run:
    """What the classifier knows of one instance's output so far."""

    level: int = LEVELS["info"]
    stopping: bool = False  # the engine asked it to stop, or vLLM began its shutdown
    traceback: int = 0  # 0: none; 1: in a traceback's frames; 2: past its exception line


@dataclass(frozen=True)
class LogLine:
    text: str
    level: int  # LEVELS: a failure is "error" whatever its tag; a planned stop's output is at most "info"
    planned_stop: bool = False
    noise: bool = False


def classify(lines: list[str]) -> list[LogLine]:
    """Each line of vLLM's log by what it means: a failure ("error": ERROR or CRITICAL lines, and tracebacks and
    exceptions outside a planned stop, tagged or not), a warning, or information; the output of an instance the
    engine (or a SIGTERM) stopped on purpose is information, whatever vLLM tags it, and the leak reports every
    process prints at exit are noise."""
    runs: dict[str, _Run] = {}
    out: list[LogLine] = []
    for line in lines:
        if line.startswith(MARK):
            if m := _RUN.match(line):
                runs[m[1]] = _Run()
            elif m := _STOPPING.match(line):
                runs.setdefault(m[1], _Run()).stopping = True
            failed = " exited with code " in line and "stopping" not in line
            out.append(LogLine(line, LEVELS["error"] if failed else LEVELS["info"]))
            continue
        m = _INSTANCE.match(line)
        name, body = (m[1], line[m.end():]) if m else ("", line)
        run = runs.setdefault(name, _Run())
        tag = _LEVEL.search(body[:80])
        if tag:
            run.level = LEVELS["error"] if tag[1] == "CRITICAL" else LEVELS[tag[1].lower()]
        if _SHUTDOWN.search(body):
            run.stopping = True
        level = run.level
        if not tag:
            if body.lstrip().startswith("Traceback (most recent call last)"):
                run.traceback = 1
            elif run.traceback == 1 and not body[:1].isspace():
                run.traceback = 2  # the exception line ends the frames; its indented details follow
            elif run.traceback == 2 and not body[:1].isspace():
                run.traceback = 0
            if run.traceback or _FAILURE.search(body):
                level = LEVELS["error"]
        else:
            run.traceback = 0
        noise = bool(_NOISE.search(body))
        if run.stopping or noise:
            out.append(LogLine(line, min(level, LEVELS["info"]), planned_stop=run.stopping, noise=noise))
        else:
            out.append(LogLine(line, level))
    return out


def _fold(lines: list[LogLine]) -> list[str]:
    """The lines, with each instance's run of leak reports at exit folded into one line saying how many."""
    out: list[str] = []
    groups: dict[str, tuple[int, int]] = {}  # instance -> (index of its fold line in out, lines folded)
    for ln in lines:
        m = _INSTANCE.match(ln.text)
        name = m[1] if m else ""
        if not ln.noise:
            groups.pop(name, None)
            out.append(ln.text)
            continue
        if name in groups:
            at, n = groups[name]
            groups[name] = (at, n + 1)
            prefix = f"[{name}] " if name else ""
            out[at] = (f"{prefix}… {n + 1} lines of leak reports at exit (nanobind, resource_tracker), folded: "
                       "harmless; the downloaded log has them")
            continue
        groups[name] = (len(out), 1)
        out.append(ln.text)
    return out


def filter_log(lines: list[str], *, hide_polling: bool, level: str, contains: str | None,
               fold: bool = True) -> list[str]:
    """Lines at ``level`` or above by what they mean (classify: "error" is a failure, never the shutdown of a
    planned stop), without health and metrics polling if asked, containing ``contains``; with ``fold``, the leak
    reports each stopping vLLM prints come as one line."""
    least = LEVELS[level]
    needle = contains.lower() if contains else None
    kept = [ln for ln in classify(lines) if ln.level >= least and not (hide_polling and POLLING.search(ln.text))
            and not (needle and needle not in ln.text.lower())]
    return _fold(kept) if fold else [ln.text for ln in kept]
