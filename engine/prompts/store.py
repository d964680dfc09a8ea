"""Saved prompts of the playground, kept in the engine's database so a team shares them."""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import col, select

from engine.db import Database, SavedPrompt


class PromptStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.session = db.session

    def prompts(self) -> Sequence[SavedPrompt]:
        with self.session() as s:
            return s.exec(select(SavedPrompt).order_by(col(SavedPrompt.id).desc())).all()

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
