"""The admin API and its store: FastAPI routes (``app``), operator actions (``services``), reads
(``queries``), the relational store (``db``, Alembic in ``migrations/``) and the audit projection
(``audit``). The Kafka log stays the source of truth: every table here is a projection of it,
except API tokens and replay jobs, which are local state whose changes are still recorded."""
