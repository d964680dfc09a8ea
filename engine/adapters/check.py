"""Whether a LoRA adapter fits a deployment, read before anything is started: its folder (inside the folders models
may come from, links resolved), its ``adapter_config.json`` (PEFT's), and its weights' shapes against the base
model's own (the safetensors headers only: a few kilobytes, no tensor is loaded).

What vLLM would refuse at load time is refused here with the reason, so a bad adapter changes nothing: a rank above
the revision's ``max_lora_rank``, a target module the base model does not have, a matrix whose shape is not the
module's, DoRA, extra trained modules (``modules_to_save``), pickled weights (``.bin``: code, not data).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import AdapterInvalidError
from engine.revisions import EngineSettings, ModelPathError, allowed_roots, check_form, resolve_local_model

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
HEADER_MAX_BYTES = 64 << 20  # a safetensors header: JSON of names, dtypes and shapes
NAME = re.compile(r"[A-Za-z0-9][\w.:-]{0,127}")  # a model name on /v1 (no /: one path segment of the API)
# base_model.model.<module>.lora_A.weight (PEFT; some writers add the adapter's name: .lora_A.default.weight)
LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight")


@dataclass(frozen=True)
class AdapterInfo:
    """What registering an adapter records: its resolved folder and what its config says."""

    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str
    size_bytes: int


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise AdapterInvalidError("name", "use 1-128 letters, digits and . _ : -, starting with a letter or digit")
    return name


def locate(value: str, data_dir: Path, roots: list[Path] | None) -> Path:
    """The adapter's folder, resolved (links followed), inside the folders models may come from."""
    try:
        check_form(value)
    except ModelPathError as exc:
        raise AdapterInvalidError("path", str(exc)) from None
    raw = Path(value).expanduser()
    candidate = raw if raw.is_absolute() else data_dir / value.removeprefix("./")
    try:
        where = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise AdapterInvalidError("path", f"no folder at {value!r}") from None
    allowed = allowed_roots(data_dir, roots)
    if not _inside(where, allowed):
        raise AdapterInvalidError("path", f"{value!r} is outside the folders models may come from "
                                          f"({', '.join(map(str, allowed))}); add one with LLMOPS_MODEL_ROOTS")
    if not where.is_dir():
        raise AdapterInvalidError("path", f"{value!r} is not a folder")
    for name in (CONFIG, WEIGHTS):  # a file of the folder that links elsewhere is read from there: not allowed
        file = where / name
        if file.is_symlink() and not _inside(file.resolve(), allowed):
            raise AdapterInvalidError("path", f"{name} links outside the folders models may come from")
    return where


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def inspect(value: str, settings: EngineSettings, *, data_dir: Path, roots: list[Path] | None) -> AdapterInfo:
    """Check the adapter at ``value`` against a deployment whose revision is ``settings``; AdapterInvalidError
    naming the field and the reason otherwise."""
    folder = locate(value, data_dir, roots)
    config = _config(folder)
    rank = config.rank
    if not settings.enable_lora:
        raise AdapterInvalidError("path", "the deployment does not serve adapters (enable_lora is off in its "
                                          "revision): apply a revision with enable_lora first")
    if rank > settings.max_lora_rank:
        raise AdapterInvalidError("path", f"its rank {rank} is above the deployment's max_lora_rank "
                                          f"{settings.max_lora_rank}: raise max_lora_rank (pre-flight counts its "
                                          "memory)")
    weights = folder / WEIGHTS
    if not weights.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise AdapterInvalidError("path", f"no {WEIGHTS} in the folder" + (
            " (adapter_model.bin is pickled code, not data: convert it to safetensors)" if pickled else ""))
    adapter = _header(weights, "path")
    targets = config.targets
    base_dir = resolve_local_model(settings.model, data_dir)
    base = _base_shapes(base_dir) if base_dir is not None and settings.load_format != "dummy" else None
    _check_weights(adapter, targets, rank, base)
    return AdapterInfo(path=folder, rank=rank, alpha=config.alpha, target_modules=targets, base_model=config.base,
                       size_bytes=weights.stat().st_size)


@dataclass(frozen=True)
class _Config:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str


def _config(folder: Path) -> _Config:
    file = folder / CONFIG
    if not file.is_file():
        raise AdapterInvalidError("path", f"no {CONFIG} in the folder: a LoRA adapter in PEFT's layout has one")
    if file.stat().st_size > CONFIG_MAX_BYTES:
        raise AdapterInvalidError("path", f"{CONFIG} is larger than {CONFIG_MAX_BYTES} bytes")
    try:
        config = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise AdapterInvalidError("path", f"{CONFIG} is not JSON ({str(exc)[:120]})") from None
    if not isinstance(config, dict):
        raise AdapterInvalidError("path", f"{CONFIG} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterInvalidError("path", f"peft_type {str(config.get('peft_type'))[:40]!r}: only LoRA adapters")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 512:
        raise AdapterInvalidError("path", f"r (the rank) must be a whole number from 1 to 512, not {str(rank)[:40]}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 < float(alpha) < 1e6:
        raise AdapterInvalidError("path", f"lora_alpha must be a positive number, not {str(alpha)[:40]}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(
            isinstance(t, str) and re.fullmatch(r"[\w.]{1,128}", t) for t in targets):
        raise AdapterInvalidError("path", "target_modules must be a list of module names (q_proj, v_proj, …)")
    if config.get("use_dora"):
        raise AdapterInvalidError("path", "a DoRA adapter (use_dora): vLLM serves LoRA only")
    if config.get("modules_to_save"):
        raise AdapterInvalidError("path", "modules_to_save: an adapter that trains whole modules of the base model "
                                          "cannot be served as a LoRA adapter by vLLM")
    base = config.get("base_model_name_or_path")
    return _Config(rank=rank, alpha=float(alpha), targets=tuple(targets),
                   base=base[:300] if isinstance(base, str) else "")


def _header(file: Path, field: str) -> dict[str, list[int]]:
    """A safetensors file's tensors and their shapes, from its header."""
    try:
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (size,) = struct.unpack("<Q", head)
            if size > HEADER_MAX_BYTES or size > os.fstat(f.fileno()).st_size - 8:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterInvalidError(field, f"{file.name} is not a safetensors file ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise AdapterInvalidError(field, f"{file.name}'s header is not a JSON object")
    shapes: dict[str, list[int]] = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        shape = value.get("shape") if isinstance(value, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
            raise AdapterInvalidError(field, f"{file.name}: tensor {key[:80]!r} has no shape")
        shapes[key] = shape
    return shapes


def _base_shapes(folder: Path) -> dict[str, list[int]] | None:
    """The base model's weights and their shapes (every safetensors file of its folder), or None if it has none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        shapes.update(_header(file, "path"))
    return shapes


def _check_weights(adapter: dict[str, list[int]], targets: tuple[str, ...], rank: int,
                   base: dict[str, list[int]] | None) -> None:
    """Each lora_A is rank x in and each lora_B out x rank of a module the base model has, of those shapes."""
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, shape in adapter.items():
        m = LORA_KEY.fullmatch(key)
        if m is None:
            raise AdapterInvalidError("path", f"tensor {key[:80]!r} is not a LoRA matrix (lora_A or lora_B)")
        pairs.setdefault(m["module"], {})[m["ab"]] = shape
    base_modules = {k.removesuffix(".weight") for k in base} if base is not None else None
    short = {name.rsplit(".", 1)[-1] for name in base_modules} if base_modules is not None else None
    if short is not None:
        missing = [t for t in targets if t.rsplit(".", 1)[-1] not in short]
        if missing:
            have = sorted(n for n in short if n.endswith("proj") or n in ("dense", "fc1", "fc2", "wo", "wi"))
            raise AdapterInvalidError("path", f"target modules {', '.join(missing)} are not modules of the base "
                                              f"model (it has {', '.join(have[:12]) or 'none of the usual ones'})")
    if not pairs:
        raise AdapterInvalidError("path", f"{WEIGHTS} holds no LoRA matrices")
    for module, ab in sorted(pairs.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise AdapterInvalidError("path", f"{module[:80]}: lora_A and lora_B come in pairs")
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterInvalidError("path", f"{module[:80]}: lora_A {a} and lora_B {b} are not of rank {rank} "
                                              "(r in adapter_config.json)")
        if base is None or base_modules is None:
            continue
        if module not in base_modules:
            raise AdapterInvalidError("path", f"{module[:80]} is not a module of the base model")
        out, inp = (base[f"{module}.weight"] + [0, 0])[:2]
        if a[1] != inp or b[0] != out:
            raise AdapterInvalidError("path", f"{module[:80]}: the adapter is {b[0]} x {a[1]}, the base model's "
                                              f"module {out} x {inp}: it was trained for another model")
