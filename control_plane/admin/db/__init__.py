"""The admin store: SQLAlchemy models (``models``) and engine/session helpers (``session``).
Schema changes go through Alembic (``migrations/``); nothing here creates tables."""
