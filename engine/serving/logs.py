"""vLLM's output: a rotating file under the data dir, the recent lines in memory, and the filters of its tail."""

from __future__ import annotations

import logging
import logging.handlers
import re
from collections import deque
from pathlib import Path


class ChildLog:
    """vLLM's output: a rotating file under the data dir plus the recent lines in memory."""

    def __init__(self, path: Path, max_bytes: int, backups: int, keep_lines: int = 5000) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                             encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger = logging.Logger(f"llmops.vllm.{id(self)}")
        self._logger.addHandler(self._handler)
        self._logger.propagate = False
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self.run_lines: deque[str] = deque(maxlen=keep_lines)  # the current child's lines only

    def new_run(self, banner: str) -> None:
        self.run_lines.clear()
        self.write(f"===== llmops: {banner} =====")

    def write(self, line: str) -> None:
        self.lines.append(line)
        self.run_lines.append(line)
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
