"""Subcommands that talk to a running engine through its API (the typed client): status, settings revisions,
deployments, start / stop / restart."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.cli.common import client_from
from engine.revisions import FIELD_NAMES, field_help
from engine.schemas import ApplyPlanOut, CapacityOut, RevisionOut, StatusOut, shown


def _print_revision(rev: RevisionOut) -> None:
    print(f"revision {rev.revision} ({rev.status}{': ' + rev.status_reason if rev.status_reason else ''}) "
          f"by {shown(rev.author)} at {rev.created_at:%Y-%m-%d %H:%M:%S} UTC"
          + (f" — {shown(rev.note)}" if rev.note else ""))
    values = rev.values.model_dump()
    width = max(len(k) for k in values)
    for key, value in values.items():
        print(f"  {key:<{width}}  {json.dumps(value)}")

class PhasePrinter:
    """Prints a start's phases as they begin, and how the start ended against its ETA (``status --wait``)."""

    def __init__(self) -> None:
        self.seen: set[tuple[int | None, str]] = set()
        self.reason: str | None = None

    def __call__(self, st: StatusOut) -> None:
        view = st.startup
        if st.state != "ready" and st.reason != self.reason and (view is None or view.ready_s is not None):
            self.reason = st.reason
            print(f"  {st.state}: {st.reason}", flush=True)
        if view is None:
            return
        if (view.revision, "") not in self.seen:
            self.seen.add((view.revision, ""))
            eta = f"; expected {view.eta_s:.0f} s ({view.eta_basis})" if view.eta_s is not None else ""
            print(f"revision {view.revision} starting{eta}", flush=True)
        for phase in view.phases:
            if (view.revision, phase.name) not in self.seen:
                self.seen.add((view.revision, phase.name))
                print(f"  +{phase.started_s:5.1f} s  {phase.title}", flush=True)
        if view.ready_s is not None and (view.revision, "ready") not in self.seen:
            self.seen.add((view.revision, "ready"))
            error = f" (ETA error {view.error_s:+.0f} s, {view.error_pct:+.0f} %)" if view.error_s is not None \
                and view.error_pct is not None else ""
            print(f"  +{view.ready_s:5.1f} s  ready{error}", flush=True)
        if view.failed and (view.revision, "failed") not in self.seen:
            self.seen.add((view.revision, "failed"))
            print(f"  +{view.elapsed_s:5.1f} s  failed: {view.failed}", flush=True)

def cmd_status(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        st = client.wait_for({"ready"}, args.wait, on_status=None if args.json else PhasePrinter()) \
            if args.wait else client.status()
    if args.json:
        print(st.model_dump_json(indent=2))
        return 0
    print(f"state: {st.state} since {st.since:%H:%M:%S} UTC — {st.reason}")
    print(f"revision: running {st.running_revision}, desired {st.desired_revision}; model {st.model}; "
          f"pid {st.pid}; vLLM {st.vllm_version} ({st.vllm_build})")
    return 0

def _parse_value(raw: str) -> Any:
    if raw.lower() in ("none", "null", ""):
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw

def cmd_settings(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        if args.action == "show":
            _print_revision(client.settings())
        elif args.action == "history":
            for rev in client.history(args.limit):
                changed = rev.note or ""
                print(f"{rev.revision:>5}  {rev.status:<10} {rev.created_at:%Y-%m-%d %H:%M:%S}  "
                      f"{shown(rev.author):<12} {shown(changed)}")
        elif args.action == "rollback":
            plan = client.capacity(client.revision(args.revision).values.model_dump()).plan
            if plan is not None:
                _print_plan(plan)
                if not args.yes and sys.stdin.isatty() and input(
                        f"roll back to revision {args.revision} by this plan? [y/N] ").strip().lower() not in (
                        "y", "yes"):
                    print("nothing written")
                    return 1
            _print_revision(client.rollback(args.revision, args.note or "", force=args.force))
        elif args.action in ("set", "check"):
            changes: dict[str, Any] = {}
            for item in args.pairs:
                key, sep, raw = item.partition("=")
                if not sep:
                    print(f"error: {item!r} is not KEY=VALUE", file=sys.stderr)
                    return 2
                changes[key.strip()] = _parse_value(raw)
            if args.action == "check":
                return _print_capacity(client.capacity(changes))
            base = client.settings()
            plan = client.capacity(changes).plan
            if plan is not None:
                _print_plan(plan)
                ask = not args.yes and sys.stdin.isatty()
                if ask and input("write this revision and apply it by this plan? [y/N] ").strip().lower() not in (
                        "y", "yes"):
                    print("nothing written")
                    return 1
            rev = client.put_settings(base.revision, changes, args.note or "", force=args.force)
            _print_revision(rev)
            for finding in rev.warnings:
                print(f"{finding.severity or 'warning'}: {finding.message}")
            print("the engine applies it with a restart; `llmops status --wait 600` waits for it")
    return 0

def _print_plan(plan: ApplyPlanOut) -> None:
    """How the apply would keep serving (the same plan the console shows before its confirmation)."""
    print(f"plan: {plan.title} ({plan.reason}); {plan.expectation()}. {plan.eta_text()}.")
    if plan.bridge is not None:
        b = plan.bridge
        print(f"  bridge: gpu_memory_utilization {b.gpu_memory_utilization:.2f}, {b.kv_tokens:,} KV tokens, "
              f"max_num_seqs {b.max_num_seqs}")
    if plan.step_etas:
        for i, s in enumerate(plan.step_etas, 1):
            print(f"  {i}. {s.text}: " + (f"about {s.eta_s:.0f} s ({s.basis})" if s.eta_s is not None else
                                         f"time not known ({s.basis})"))
    else:
        for i, step in enumerate(plan.steps, 1):
            print(f"  {i}. {step}")
    if plan.eta_note:
        print(f"  about these times: {plan.eta_note}")
    for warning in plan.warnings:
        print(f"  warning: {warning}")

def _print_capacity(result: CapacityOut) -> int:
    pred = result.prediction
    if pred:
        print(f"KV cache: {pred.kv_gib} GiB = {pred.kv_tokens:,} tokens ({pred.kv_bytes_per_token:,} B/token); "
              f"weights {pred.weight_gib} GiB; {pred.max_concurrency}x requests of {pred.tokens_per_request:,} "
              "tokens" + ("" if pred.calibrated or pred.device == "cpu" else " (uncalibrated)"))
    for kind, findings in (("error", result.errors), ("warning", result.warnings)):
        for finding in findings:
            fit = ", ".join(f"{k}={v}" for k, v in finding.fit.items())
            print(f"{kind}: {finding.message}" + (f" [fits: {fit}]" if fit else ""))
    if result.plan is not None:
        _print_plan(result.plan)
    return 0 if result.ok else 1

def settings_epilog() -> str:
    return "fields:\n" + "\n".join(f"  {name}: {field_help(name)}" for name in FIELD_NAMES)

def _pairs(items: list[str]) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            print(f"error: {item!r} is not KEY=VALUE", file=sys.stderr)
            return None
        out[key.strip()] = _parse_value(raw)
    return out

def cmd_deployments(args: argparse.Namespace) -> int:
    args.deployment = None  # these commands name their deployment themselves
    with client_from(args) as client:
        if args.action == "list":
            for d in client.deployments():
                mark = "*" if d.default else " "
                print(f"{mark}{d.id:>3}  {d.name:<24} {'enabled ' if d.enabled else 'disabled'} {d.state:<9} "
                      f"running {d.running_revision} desired {d.desired_revision}  {d.model}"
                      + (f"  gpus {','.join(map(str, d.gpus))}" if d.gpus else ""))
            return 0
        if args.action == "create":
            values = _pairs(args.pairs)
            if values is None:
                return 2
            gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
            made = client.create_deployment(args.name, values, gpus=gpus, enabled=not args.disabled,
                                            note=args.note or "", force=args.force)
            print(f"deployment {made.id} {made.name} created with revision {made.revision}: {made.reason}")
            for warning in made.warnings:
                print(f"warning: {warning.get('message')}")
            return 0
        if args.action in ("enable", "disable"):
            done = client.update_deployment(args.name, enabled=args.action == "enable")
            print(f"deployment {done.name} {args.action}d")
            return 0
        gone = client.deletion(args.name)
        print(f"deleting {gone.name} stops its instances and removes {gone.revisions} revisions, {gone.events} "
              f"events, {gone.benchmarks} benchmarks and {gone.requests} ledger rows (the audit keeps its records)")
        if not args.yes and sys.stdin.isatty() and input("delete it? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
        client.delete_deployment(args.name, confirm=gone.name)
        print(f"deployment {gone.name} deleted")
    return 0

def cmd_ctl(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        st = client.engine_action(args.action)
    print(f"{args.action} accepted (state was {st.state})")
    return 0
