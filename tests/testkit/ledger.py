"""The request ledger as far as the gateway writes to it: what it recorded, and no prompt sampled."""

from __future__ import annotations

from engine.gateway.ledger import Record


class Records:
    def __init__(self) -> None:
        self.records: list[Record] = []

    def record(self, rec: Record) -> None:
        self.records.append(rec)

    def sample_prompt(self) -> bool:
        return False
