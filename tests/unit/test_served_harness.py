"""The test harness's in-process uvicorn: a server that cannot start says so at once (CI once saw a served app that
never started and waited out its 30 s; its port is now bound before the server runs, so no other socket takes it)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI

from tests.testkit.served import serve


# uvicorn ends its thread with SystemExit when the app's startup fails: expected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_app_whose_startup_fails_is_an_error_at_once_not_after_the_wait() -> None:
    @asynccontextmanager
    async def failing(_: FastAPI) -> AsyncIterator[None]:
        raise RuntimeError("this app cannot start")
        yield  # pragma: no cover

    started = time.monotonic()
    with pytest.raises(AssertionError, match="ended before it served"), serve(FastAPI(lifespan=failing)):
        pass
    assert time.monotonic() - started < 10

