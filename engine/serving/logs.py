"""vLLM's output: a rotating file under the data dir, the recent lines in memory, and the filters of its tail."""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
from collections import deque
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
        self.write(f"===== llmops: {banner} =====")

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


def filter_log(lines: list[str], *, hide_polling: bool, level: str, contains: str | None) -> list[str]:
    """Lines at ``level`` or above (a line without a level, a traceback's say, has its predecessor's), without
    health and metrics polling if asked, containing ``contains``."""
    least, current, out = LEVELS[level], 1, []
    needle = contains.lower() if contains else None
    for line in lines:
        if m := _LEVEL.search(line[:80]):
            current = 3 if m[1] == "CRITICAL" else LEVELS[m[1].lower()]
        if current < least or (hide_polling and POLLING.search(line)) or (needle and needle not in line.lower()):
            continue
        out.append(line)
    return out
