"""The sandbox of every vLLM child (engine/vllm_sandbox.py, issue 31 item 7): vLLM runs a model's code as the
engine's user, beside the engine's secrets in its data dir. Its Landlock rules hide the data dir but for models/
(and the caches vLLM's environment puts there), make the engine's code read-only and leave the rest as it is; a
real child started through the wrapper cannot open the database nor the admin token, and runs as before."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config import AppConfig
from engine.errors import SandboxUnavailableError
from engine.vllm import ChildLog, VllmChild, build_env, free_port, remove_ipc_folder, sandbox_for, sandbox_problem
from engine.vllm.command import ENGINE_CODE
from engine.vllm_sandbox import Rule, Sandbox, parse, plan
from tests.testkit.wait import eventually, wait_until


def data_dir_of_an_engine(root: Path) -> Path:
    """A data dir as a running engine has it: the database and its journals, run/ (the CLI's admin token, the
    console's key, pid files), logs/, models/ (the demo model's config)."""
    data = root / "data"
    for folder in ("run", "logs", "models/demo"):
        (data / folder).mkdir(parents=True)
    for name, text in {"llmops.db": "password hashes", "llmops.db-wal": "wal", "llmops.db-shm": "shm",
                       "run/cli.token": "llmops_admin_token", "run/console.key": "console key",
                       "run/vllm-a.json": "{}", "logs/engine.log": "engine log",
                       "models/demo/config.json": '{"model_type": "llama"}'}.items():
        (data / name).write_text(text)
    return data


def ancestors(path: Path) -> list[str]:
    return [str(p) for p in reversed(path.parents)]


# --- the plan ----------------------------------------------------------------------------------------------------


def test_the_plan_hides_the_data_dir_but_its_models_and_leaves_every_other_entry_on_the_way(tmp_path: Path) -> None:
    data = data_dir_of_an_engine(tmp_path)
    (tmp_path / "beside").mkdir()
    (tmp_path / "beside" / "f").write_text("x")
    (tmp_path / "note.txt").write_text("x")
    (tmp_path / "to-data").symlink_to(data)  # a link is reached where it points: no rule of its own
    rules = plan(hide=[str(data)], keep=[str(data / "models")])
    by_path = {r.path: r.access for r in rules}
    assert len(by_path) == len(rules)  # one rule a path

    # the way from / to the data dir: each folder can be listed, nothing more (else all beneath it were allowed)
    for folder in [*ancestors(data), str(data)]:
        assert by_path[folder] == "list", folder
    # every other entry of a folder on the way keeps all its rights: folders beneath them, files on their own
    assert by_path[str(tmp_path / "beside")] == "all"
    assert by_path[str(tmp_path / "note.txt")] == "all"
    assert str(tmp_path / "beside" / "f") not in by_path  # covered by its folder's rule
    assert by_path["/usr"] == "all" and by_path["/proc"] == "all"
    for entry in os.listdir(tmp_path.parent):  # the siblings of the test's folder, whatever they are
        if entry != tmp_path.name and not os.path.islink(tmp_path.parent / entry):
            assert by_path[str(tmp_path.parent / entry)] == "all"
    assert str(tmp_path / "to-data") not in by_path
    # of the data dir, models/ only; nothing beneath the rest, nor the database's journals, has a rule
    assert by_path[str(data / "models")] == "all"
    hidden = [p for p in by_path if p.startswith(f"{data}/") and p != str(data / "models")]
    assert hidden == []


def test_the_deepest_named_path_decides_and_a_path_that_is_not_there_hides_nothing(tmp_path: Path) -> None:
    data = data_dir_of_an_engine(tmp_path)
    (data / "models" / "private").mkdir()
    rules = plan(hide=[str(data), str(data / "models" / "private")], read=[str(tmp_path / "code")],
                 keep=[str(data / "models")])
    by_path = {r.path: r.access for r in rules}
    assert str(tmp_path / "code") not in by_path  # not there: nothing named
    assert by_path[str(data / "models")] == "list"  # on the way to models/private
    assert by_path[str(data / "models" / "demo")] == "all"
    assert str(data / "models" / "private") not in by_path

    (tmp_path / "code").mkdir()
    read_only = plan(hide=[str(data)], read=[str(tmp_path / "code")])
    assert Rule(str(tmp_path / "code"), "read") in read_only
    # named twice: the stricter level wins
    assert str(data / "models") not in {r.path for r in plan(hide=[str(data / "models")], keep=[str(data / "models")])}
    # nothing there to hide (another host's paths): all of / as it is
    assert plan(hide=[str(tmp_path / "absent" / "data")]) == [Rule("/", "all")]


def test_the_engine_sandbox_keeps_what_vllm_needs_and_never_a_secret(tmp_path: Path) -> None:
    data = data_dir_of_an_engine(tmp_path)
    (data / "hf").mkdir()
    env = {"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"), "HF_HOME": str(data / "hf"),
           "XDG_CACHE_HOME": str(data), "VLLM_CACHE_ROOT": str(data / "run" / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(data / "logs")}
    (tmp_path / "tmp").mkdir()
    key = tmp_path / "elsewhere" / "console.key"
    sandbox = sandbox_for(data, env, secrets=[key], model_roots=[data / "models" / "demo", tmp_path / "roots"])
    assert set(sandbox.hide) >= {str(data), str(data / "llmops.db"), str(data / "llmops.db-wal"),
                                 str(data / "llmops.db-shm"), str(data / "run"), str(data / "logs"), str(key)}
    # models/ and a cache its environment puts in the data dir; not the data dir itself, nor run/ or logs/
    assert set(sandbox.keep) == {str(data / "models"), str(data / "models" / "demo"), str(data / "hf")}
    assert str(ENGINE_CODE) in sandbox.read and os.path.realpath(sys.prefix) in sandbox.read
    assert env["TMPDIR"] == str(tmp_path / "tmp")  # a temp folder off the way stays


def test_a_temp_folder_on_the_way_to_the_data_dir_is_replaced_by_one_inside_it(tmp_path: Path) -> None:
    """vLLM cannot make anything in a folder on the way to a hidden path (its IPC sockets in /tmp, with a data dir
    in /tmp): its TMPDIR becomes DATA_DIR/tmp, and HOME's cache folders are made before it starts."""
    data = data_dir_of_an_engine(tmp_path / "home")
    env = {"TMPDIR": str(tmp_path), "HOME": str(tmp_path / "home")}
    sandbox = sandbox_for(data, env)
    assert env["TMPDIR"] == str(data / "tmp") and (data / "tmp").is_dir()
    assert str(data / "tmp") in sandbox.keep
    assert all((tmp_path / "home" / name).is_dir() for name in (".cache", ".triton"))
    hidden_tmp = {"TMPDIR": str(data / "run")}  # a temp folder among the secrets moves too
    sandbox_for(data, hidden_tmp)
    assert hidden_tmp["TMPDIR"] == str(data / "tmp")


def deep(root: Path) -> Path:
    """A data dir whose DATA_DIR/tmp/<uuid4> is over a socket path's 107 bytes (as in pytest-103's folders)."""
    return data_dir_of_an_engine(root / ("d" * max(1, 80 - len(str(root)))))


def test_vllm_sockets_get_a_short_private_folder_where_the_temp_folder_is_too_deep(tmp_path: Path) -> None:
    """vLLM names its ZMQ sockets TMPDIR/<uuid4>; a private TMPDIR in a deep data dir made every start fail
    ("ipc path ... is longer than 107 characters"): the sockets get a short folder of the engine's user's own."""
    data = deep(tmp_path)
    env = {"TMPDIR": str(tmp_path)}  # on the way to the data dir: it moves into it, and is too deep there
    sandbox = sandbox_for(data, env)
    assert env["TMPDIR"] == str(data / "tmp") and len(env["TMPDIR"]) + 37 > 107
    base = Path(env["VLLM_RPC_BASE_PATH"])
    assert len(str(base)) + 37 <= 107 and base.is_dir() and not base.is_symlink()
    assert base.stat().st_mode & 0o777 == 0o700 and base.stat().st_uid == os.getuid()
    assert sandbox.can_make_in(str(base))
    again = {"TMPDIR": str(tmp_path)}
    sandbox_for(data, again)  # the same engine gets the same folder
    assert again["VLLM_RPC_BASE_PATH"] == str(base)
    chosen = {"TMPDIR": str(tmp_path), "VLLM_RPC_BASE_PATH": "/run/vllm"}
    sandbox_for(data, chosen)
    assert chosen["VLLM_RPC_BASE_PATH"] == "/run/vllm"  # short enough: the operator's own choice stands


def test_the_socket_folder_goes_with_the_engine_and_nothing_else_by_its_name(tmp_path: Path) -> None:
    """The engine's end removes the short folder it made for vLLM's sockets, with the sockets left in it (each
    test's engine on a deep data dir had left one in /tmp: 1,192 of them); one it did not give its children, a
    link, or a folder open to others by that name is left where it is."""
    data = deep(tmp_path)

    def given() -> Path:
        env = {"TMPDIR": str(tmp_path)}
        sandbox_for(data, env)
        return Path(env["VLLM_RPC_BASE_PATH"])

    base = given()
    try:
        (base / "0b6c3c0e-stale-socket").write_bytes(b"")  # what vLLM's ZMQ sockets leave
        remove_ipc_folder(data)
        assert not base.exists()
        remove_ipc_folder(data)  # none: nothing to do, no error
        base.mkdir(mode=0o700)  # the engine's user's, but not given by this process: another engine's
        remove_ipc_folder(data)
        assert base.is_dir()
        assert given() == base
        base.rmdir()
        base.symlink_to(tmp_path)  # given, then swapped for a link
        remove_ipc_folder(data)
        assert base.is_symlink() and tmp_path.exists()
        base.unlink()
        assert given() == base
        os.chmod(base, 0o755)  # given, then opened to others: not the engine's own any more
        (base / "theirs").write_bytes(b"")
        remove_ipc_folder(data)
        assert (base / "theirs").exists()
    finally:
        if base.is_symlink():
            base.unlink()
        shutil.rmtree(base, ignore_errors=True)


def test_a_planted_socket_folder_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user (or a link) in the engine's place in a shared temp folder: vLLM's sockets go elsewhere."""
    import tempfile

    data = deep(tmp_path)
    probe: dict[str, str] = {"TMPDIR": str(tmp_path)}
    sandbox_for(data, probe)
    name = Path(probe["VLLM_RPC_BASE_PATH"]).name
    shared = tmp_path / "s"
    shared.mkdir()
    (shared / name).symlink_to(tmp_path)  # a link planted where the engine would make its folder
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    env = {"TMPDIR": str(tmp_path)}
    sandbox_for(data, env)
    assert env["VLLM_RPC_BASE_PATH"] != str(shared / name)
    assert not Path(env["VLLM_RPC_BASE_PATH"]).is_symlink()
    (shared / name).unlink()
    (shared / name).mkdir(mode=0o755)  # open to others: not private
    os.chmod(shared / name, 0o755)
    env = {"TMPDIR": str(tmp_path)}
    sandbox_for(data, env)
    assert env["VLLM_RPC_BASE_PATH"] != str(shared / name)


BIND = """
import os, tempfile, uuid, zmq
s = zmq.Context().socket(zmq.ROUTER)  # as vllm.utils.network_utils.get_open_zmq_ipc_path names it
s.bind(f"ipc://{os.environ.get('VLLM_RPC_BASE_PATH', tempfile.gettempdir())}/{uuid.uuid4()}")
print("bound", flush=True)
"""


def test_a_sandboxed_child_binds_its_sockets_with_a_deep_data_dir(tmp_path: Path) -> None:
    """What vLLM does first at start, inside the real sandbox: bind a ZMQ socket where it names them."""
    if (problem := sandbox_problem()) is not None:
        pytest.skip(f"no Landlock here: {problem}")
    data = deep(tmp_path)
    env = build_env({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": str(tmp_path)}, api_key="k")
    sandbox = sandbox_for(data, env)

    async def go() -> list[str]:
        log = ChildLog(data / "logs" / "vllm.log", 1 << 20, 1)
        child = VllmChild([sys.executable, "-c", BIND], env, free_port(), 1, log, data / "run" / "vllm-a.json",
                          cwd=data, sandbox=sandbox)
        await child.spawn()
        await eventually(lambda: child.exited and child.returncode is not None, 60, every=0.05,
                         what="the socket probe's exit")
        await child.stop(5)
        return list(child.lines)

    lines = asyncio.run(go())
    assert "bound" in lines, lines


def test_the_engine_secrets_include_a_sqlite_database_outside_the_data_dir(tmp_path: Path) -> None:
    from engine.serving.launcher import engine_secrets

    config = AppConfig(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path}/state/engine.db")
    secrets = engine_secrets(config)
    assert tmp_path / "data" / "run" / "console.key" in secrets
    assert {tmp_path / "state" / n for n in ("engine.db", "engine.db-wal", "engine.db-shm")} <= set(secrets)
    assert engine_secrets(AppConfig(data_dir=tmp_path / "data")) == [tmp_path / "data" / "run" / "console.key"]


def test_the_wrapper_command_line_round_trips() -> None:
    sandbox = Sandbox(hide=("/d",), read=("/e",), keep=("/d/models",), host="boot")
    wrapped = sandbox.wrap(["/py", "-m", "vllm.entrypoints.openai.api_server", "--port", "1"], python="/py")
    assert wrapped[:3] == ["/py", "-m", "engine.vllm_sandbox"]
    assert parse(wrapped[3:]) == (sandbox, ["/py", "-m", "vllm.entrypoints.openai.api_server", "--port", "1"])
    with pytest.raises(ValueError, match="no command"):
        parse(["--hide", "/d"])
    # a child started at a lower priority: the wrapper starts at it too (nice first, the same pid throughout)
    niced = sandbox.wrap(["/usr/bin/nice", "-n", "29", "/py", "-m", "vllm"], python="/py")
    assert niced[:6] == ["/usr/bin/nice", "-n", "29", "/py", "-m", "engine.vllm_sandbox"]
    assert parse(niced[6:]) == (sandbox, ["/py", "-m", "vllm"])


def test_no_landlock_is_said_and_the_engine_starts_vllm_unconfined(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    import engine.deployments.fleet as fleet
    import engine.vllm_sandbox as sandbox_module

    def enosys(*_: object) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(sandbox_module, "_syscall", enosys)
    with pytest.raises(SandboxUnavailableError, match="no Landlock"):
        sandbox_module.abi_version()

    monkeypatch.setattr(fleet, "sandbox_problem", lambda: "this kernel has no Landlock")
    said = fleet.Fleet.unconfined(SimpleNamespace(config=AppConfig(data_dir=tmp_path)))  # type: ignore[arg-type]
    assert said is not None and "unconfined" in said and "no Landlock" in said and "cli.token" in said
    off = fleet.Fleet.unconfined(SimpleNamespace(config=AppConfig(data_dir=tmp_path,  # type: ignore[arg-type]
                                                                  vllm_sandbox=False)))
    assert off is not None and off.startswith("vllm_sandbox is off")
    monkeypatch.setattr(fleet, "sandbox_problem", lambda: None)
    assert fleet.Fleet.unconfined(SimpleNamespace(config=AppConfig(data_dir=tmp_path))) is None  # type: ignore[arg-type]


def test_the_wrapper_never_runs_vllm_unconfined_when_it_was_meant_to_be_and_hides_nothing_elsewhere(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import engine.vllm_sandbox as sandbox_module

    ran: list[list[str]] = []

    def refused(_: object) -> int:
        raise SandboxUnavailableError("Landlock could not be used (Operation not permitted)")

    def execvp(_: str, args: list[str]) -> None:
        ran.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(sandbox_module, "restrict", refused)
    monkeypatch.setattr(os, "execvp", execvp)
    monkeypatch.setattr(sandbox_module, "boot_id", lambda: "this-host")
    with pytest.raises(SystemExit) as exited:
        sandbox_module.main(["--hide", "/d", "--host", "this-host", "--", "vllm"])
    assert exited.value.code == sandbox_module.EXIT_UNCONFINED and ran == []
    assert "vllm_sandbox" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a Ray node on another host: nothing of the engine's is there
        sandbox_module.main(["--hide", "/d", "--host", "engine-host", "--", "vllm"])
    assert ran == [["vllm"]] and "not the engine's host" in capsys.readouterr().out


# --- a real child through the wrapper ------------------------------------------------------------------------------

# What a vLLM child (or a model's code in it) would try; each line: what, and the outcome.
PROBE = r"""
import json, os, subprocess, sys, tempfile
data, engine_code = sys.argv[1], sys.argv[2]
def attempt(what, fn):
    try:
        fn()
        print(json.dumps([what, "ok"]), flush=True)
    except OSError as exc:
        print(json.dumps([what, type(exc).__name__]), flush=True)
def read(path):
    return lambda: open(path, "rb").read()
def write(path):
    return lambda: open(path, "w").write("x")
attempt("database", read(os.path.join(data, "llmops.db")))
attempt("database wal", read(os.path.join(data, "llmops.db-wal")))
attempt("admin token", read(os.path.join(data, "run", "cli.token")))
attempt("console key", read(os.path.join(data, "run", "console.key")))
attempt("engine log", read(os.path.join(data, "logs", "engine.log")))
attempt("overwrite the admin token", write(os.path.join(data, "run", "cli.token")))
attempt("new file in the data dir", write(os.path.join(data, "planted")))
attempt("list the data dir", lambda: os.listdir(data))
attempt("model config", read(os.path.join(data, "models", "demo", "config.json")))
attempt("model write", write(os.path.join(data, "models", "demo", "written")))
attempt("venv", read(os.path.join(sys.prefix, "pyvenv.cfg") if os.path.exists(os.path.join(sys.prefix, "pyvenv.cfg"))
                     else os.__file__))
attempt("engine code", read(os.path.join(engine_code, "vllm_guard.py")))
attempt("change engine code", write(os.path.join(engine_code, "planted.py")))
attempt("temp file", lambda: tempfile.TemporaryFile().write(b"x"))
grandchild = subprocess.run([sys.executable, "-c", f"open({os.path.join(data, 'run', 'cli.token')!r}).read()"],
                            capture_output=True, text=True)
print(json.dumps(["grandchild admin token", "PermissionError" if "PermissionError" in grandchild.stderr
                  else f"exit {grandchild.returncode}"]), flush=True)
print(json.dumps(["python", str(sum(range(10)))]), flush=True)
"""


def test_a_child_started_through_the_sandbox_cannot_open_the_engine_secrets(tmp_path: Path) -> None:
    if (problem := sandbox_problem()) is not None:
        pytest.skip(f"no Landlock here: {problem}")
    data = data_dir_of_an_engine(tmp_path)
    env = build_env({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"),
                     "TMPDIR": str(tmp_path)}, api_key="k")  # its temp folder holds the data dir: it moves
    sandbox = sandbox_for(data, env, secrets=[data / "run" / "console.key"])
    assert env["TMPDIR"] == str(data / "tmp")

    async def go() -> dict[str, str]:
        log = ChildLog(data / "logs" / "vllm.log", 1 << 20, 1)
        child = VllmChild([sys.executable, "-c", PROBE, str(data), str(ENGINE_CODE)], env, free_port(), 1, log,
                          data / "run" / "vllm-a.json", cwd=data, sandbox=sandbox)
        await child.spawn()
        await eventually(lambda: child.exited and child.returncode is not None, 60, every=0.05,
                         what="the probe's exit")
        await child.stop(5)
        assert child.returncode == 0, list(child.lines)
        return dict(json.loads(line) for line in child.lines if line.startswith("["))

    seen = asyncio.run(go())
    assert {k: seen[k] for k in ("database", "database wal", "admin token", "console key", "engine log",
                                 "overwrite the admin token", "new file in the data dir", "change engine code",
                                 "grandchild admin token")} == {
        "database": "PermissionError", "database wal": "PermissionError", "admin token": "PermissionError",
        "console key": "PermissionError", "engine log": "PermissionError",
        "overwrite the admin token": "PermissionError", "new file in the data dir": "PermissionError",
        "change engine code": "PermissionError", "grandchild admin token": "PermissionError"}
    assert {k: seen[k] for k in ("list the data dir", "model config", "model write", "venv", "engine code",
                                 "temp file", "python")} == {
        "list the data dir": "ok", "model config": "ok", "model write": "ok", "venv": "ok", "engine code": "ok",
        "temp file": "ok", "python": "45"}
    assert not (ENGINE_CODE / "planted.py").exists() and not (data / "planted").exists()
    log = (data / "logs" / "vllm.log").read_text()  # its output reached its log (the engine writes it)
    assert "llmops sandbox: hidden" in log and '["python", "45"]' in log


def test_a_ray_actor_starts_its_vllm_in_the_sandbox_too(tmp_path: Path) -> None:
    """On a Ray node that is the engine's host (the same boot id) the actor starts vLLM through the wrapper as the
    engine does: the engine's admin token cannot be opened there either."""
    if (problem := sandbox_problem()) is not None:
        pytest.skip(f"no Landlock here: {problem}")
    from engine.placement.actor import VllmProcessImpl

    data = data_dir_of_an_engine(tmp_path)
    env = build_env({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": str(tmp_path)}, api_key="k")
    script = (f"try:\n    open({str(data / 'run' / 'cli.token')!r}).read(); print('read')\n"
              "except PermissionError:\n    print('refused')\n")
    actor = VllmProcessImpl("a")
    actor.start([sys.executable, "-c", script], env, str(tmp_path / "node"), host="127.0.0.1",
                sandbox=sandbox_for(data, env))
    assert actor.wait() == 0
    said = wait_until(lambda: [ln for ln in actor.read(0)[1] if ln in ("read", "refused")], 10,
                      what="the probe's answer in the actor's lines")
    assert said == ["refused"] and actor.read(0)[1][0].startswith("llmops sandbox: hidden")
