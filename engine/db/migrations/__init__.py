"""The engine's schema migrations (Alembic): env.py, the revision template and versions/, one file a revision.

They ship inside the engine package and run through engine/db/schema.py (at every start, and by
``llmops db upgrade``); there is no alembic.ini. A new revision: ``llmops db revision -m "what changes"``.
"""
