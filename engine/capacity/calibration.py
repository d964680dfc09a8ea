"""Read the memory terms vLLM logs at start-up, and keep the last measurement per host and model.

Wording drifts between releases (0.26: "Actual usage is W GiB for weight, A GiB for peak activation, N GiB for
non-torch memory, and G GiB for CUDAGraph memory"; later: "W+N GiB for consumed memory (weights + non-torch)"),
so each term has a pattern per wording, all here.
"""

from __future__ import annotations

import itertools
import re
import socket
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlmodel import col, select

from engine.capacity.model import GIB, Calibration
from engine.db import CalibrationRow, Database
from engine.revisions import EngineSettings

_NUM = r"(-?[\d,]+(?:\.\d+)?)"


def _f(text: str) -> float:
    return float(text.replace(",", ""))


PATTERNS: dict[str, re.Pattern[str]] = {
    "weights": re.compile(rf"Model loading took {_NUM} GiB"),
    "kv_gib": re.compile(rf"Available KV cache memory: {_NUM} GiB"),
    "kv_tokens": re.compile(rf"(?:GPU|CPU|XPU) KV cache size: {_NUM} tokens"),
    "concurrency": re.compile(rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x"),
    "desired": re.compile(rf"Free memory on device \({_NUM}/{_NUM} GiB\) on startup\. Desired GPU memory "
                          rf"utilization is \({_NUM}, {_NUM} GiB\)"),
    "usage_026": re.compile(rf"Actual usage is {_NUM} GiB for weight, {_NUM} GiB for peak activation, {_NUM} GiB "
                            rf"for non-torch memory, and {_NUM} GiB for CUDAGraph memory"),
    "usage_new": re.compile(rf"Actual usage is {_NUM} GiB for consumed memory \(weights \+ non-torch\), {_NUM} GiB "
                            rf"for peak activation, and {_NUM} GiB for CUDAGraph memory"),
    "cpu_explicit": re.compile(rf"Explicitly set \({_NUM}/{_NUM}\) GiB for KV cache"),
    "backend": re.compile(r"Using (\w+) attention backend"),
    "block_size": re.compile(r"Setting kv cache block size to (\d+) for (\w+) backend"),
    "padding": re.compile(r"Add (\d+) padding layers"),
}


@dataclass
class StartReport:
    """What one start of vLLM logged about memory (GiB unless named otherwise)."""

    weights_gib: float | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    free_gib: float | None = None
    total_gib: float | None = None
    utilization: float | None = None
    requested_gib: float | None = None
    kv_gib: float | None = None
    kv_tokens: int | None = None
    concurrency_len: int | None = None
    concurrency: float | None = None
    attention_backend: str | None = None  # e.g. FLASH_ATTN, FLASH_ATTN_MLA
    block_size: int | None = None  # logged only when the backend changes vLLM's default of 16
    padding_layers: int = 0  # hybrid models: layers added so that every KV group has as many

    @property
    def complete(self) -> bool:
        return None not in (self.weights_gib, self.activation_gib, self.non_torch_gib, self.requested_gib,
                            self.kv_gib)


def parse_start(lines: Iterable[str]) -> StartReport:
    r = StartReport()
    for line in lines:
        if m := PATTERNS["weights"].search(line):
            r.weights_gib = _f(m[1])
        elif m := PATTERNS["kv_gib"].search(line):
            r.kv_gib = _f(m[1])
        elif m := PATTERNS["kv_tokens"].search(line):
            r.kv_tokens = int(_f(m[1]))
            if c := PATTERNS["concurrency"].search(line):  # the CPU build logs both on one line
                r.concurrency_len, r.concurrency = int(_f(c[1])), _f(c[2])
        elif m := PATTERNS["concurrency"].search(line):
            r.concurrency_len, r.concurrency = int(_f(m[1])), _f(m[2])
        if m := PATTERNS["desired"].search(line):
            r.free_gib, r.total_gib, r.utilization, r.requested_gib = (_f(x) for x in m.groups())
        if m := PATTERNS["usage_026"].search(line):
            r.weights_gib, r.activation_gib, r.non_torch_gib, r.cudagraph_gib = (_f(x) for x in m.groups())
        elif m := PATTERNS["usage_new"].search(line):
            consumed, r.activation_gib, r.cudagraph_gib = (_f(x) for x in m.groups())
            if r.weights_gib is not None:
                r.non_torch_gib = round(consumed - r.weights_gib, 4)
        if m := PATTERNS["cpu_explicit"].search(line):
            r.kv_gib = _f(m[1])
        if r.attention_backend is None and (m := PATTERNS["backend"].search(line)):
            r.attention_backend = m[1]
        if m := PATTERNS["block_size"].search(line):
            r.block_size = int(m[1])
        if m := PATTERNS["padding"].search(line):
            r.padding_layers += int(m[1])
    if r.kv_gib is not None and r.requested_gib is not None and r.weights_gib is not None \
            and r.activation_gib is not None and r.non_torch_gib is None:
        r.non_torch_gib = round(r.requested_gib - r.kv_gib - r.weights_gib - r.activation_gib, 4)
    return r


def _bytes(gib: float | None) -> int:
    return round((gib or 0.0) * GIB)


class CalibrationStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.host = socket.gethostname()

    def record(self, report: StartReport, settings: EngineSettings, batched_tokens: int, activation_estimate: int,
               revision_id: int | None, lora: int = 0) -> CalibrationRow | None:
        """Keep a successful GPU start's terms; CPU starts (explicit KV size) have nothing to calibrate. ``lora``:
        the LoRA buffers vLLM loaded with the weights (capacity.model.lora_bytes), kept out of them so that one
        calibration serves a revision with LoRA on or off."""
        if not report.complete or activation_estimate <= 0:
            return None
        assert report.requested_gib is not None and report.utilization
        row = CalibrationRow(
            host=self.host, model=settings.model, revision_id=revision_id,
            tensor_parallel_size=settings.tensor_parallel_size, dtype=settings.dtype,
            enforce_eager=settings.enforce_eager, batched_tokens=batched_tokens, max_num_seqs=settings.max_num_seqs,
            weights=max(0, _bytes(report.weights_gib) - lora), activation=_bytes(report.activation_gib),
            activation_estimate=activation_estimate, non_torch=_bytes(report.non_torch_gib),
            device_total=_bytes(report.requested_gib / report.utilization),
            kv_bytes=_bytes(report.kv_gib), kv_tokens=report.kv_tokens,
        )
        with self.db.session() as s:
            s.add(row)
        return row

    def latest(self, model: str, tensor_parallel_size: int, dtype: str, starts: int = 5) -> Calibration | None:
        """The calibration from the last ``starts`` successful starts of this model on this host."""
        with self.db.read() as s:
            rows = s.exec(
                select(CalibrationRow).where(CalibrationRow.host == self.host, CalibrationRow.model == model,
                                             CalibrationRow.tensor_parallel_size == tensor_parallel_size,
                                             CalibrationRow.dtype == dtype)
                .order_by(col(CalibrationRow.id).desc()).limit(starts)
            ).all()
        return to_calibration(rows) if rows else None


def to_calibration(rows: Sequence[CalibrationRow]) -> Calibration:
    """Newest first: stable terms from the newest row, the activation factor as the median over all rows."""
    newest = rows[0]
    factors = [r.activation / r.activation_estimate for r in rows if r.activation_estimate > 0]
    return Calibration(weights=newest.weights, non_torch=newest.non_torch, device_total=newest.device_total,
                       activation_factor=statistics.median(factors) if factors else 1.0,
                       tensor_parallel_size=newest.tensor_parallel_size, dtype=newest.dtype, starts=len(rows))


def logged_batched_tokens(lines: Iterable[str]) -> int | None:
    """max_num_batched_tokens as vLLM chose it ("Chunked prefill is enabled with max_num_batched_tokens=8192")."""
    for line in lines:
        if "max_num_batched_tokens=" in line:
            tail = line.split("max_num_batched_tokens=", 1)[1]
            digits = "".join(itertools.takewhile(str.isdigit, tail))
            if digits:
                return int(digits)
    return None
