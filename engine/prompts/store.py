"""Saved prompts of the playground, kept in the engine's database so a team shares them: newest first, a page at
a time, each with its author."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func
from sqlmodel import col, select

from engine.db import Database, SavedPrompt


class PromptStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.session = db.session

    def prompts(self, limit: int = 50, before: int | None = None) -> Sequence[SavedPrompt]:
        """A page of saved prompts, newest first: at most ``limit``, with ids below ``before`` when given."""
        with self.db.read() as s:
            q = select(SavedPrompt)
            if before is not None:
                q = q.where(col(SavedPrompt.id) < before)
            return s.exec(q.order_by(col(SavedPrompt.id).desc()).limit(limit)).all()

    def get(self, prompt_id: int) -> SavedPrompt | None:
        with self.db.read() as s:
            return s.get(SavedPrompt, prompt_id)

    def count_by(self, author: str) -> int:
        with self.session() as s:
            return int(s.exec(select(func.count()).select_from(SavedPrompt)
                              .where(SavedPrompt.author == author)).one())

    def save_prompt(self, prompt: SavedPrompt) -> SavedPrompt:
        with self.session() as s:
            s.add(prompt)
            s.flush()
            return prompt

    def delete_prompt(self, prompt_id: int) -> bool:
        with self.session() as s:
            found = s.get(SavedPrompt, prompt_id)
            if found is None:
                return False
            s.delete(found)
            return True
