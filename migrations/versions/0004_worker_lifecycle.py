"""workers: the lifecycle each row folds by (common/fleet.py): registered, draining, ended epochs

Rows written before it are read as their one incarnation in its state (as the router view
reads a snapshot written before lifecycles were kept).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06 23:00:00
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ('registered_epoch', 'draining_epoch', 'ended_epoch')


def upgrade() -> None:
    with op.batch_alter_table('workers') as batch:
        for name in _COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger(), server_default='-1', nullable=False))
    op.execute("UPDATE workers SET "
               "registered_epoch = CASE WHEN state = 'unregistered' THEN -1 ELSE epoch END, "
               "draining_epoch = CASE WHEN state = 'draining' THEN epoch ELSE -1 END, "
               "ended_epoch = CASE WHEN state = 'gone' THEN epoch ELSE -1 END")


def downgrade() -> None:
    with op.batch_alter_table('workers') as batch:
        for name in reversed(_COLUMNS):
            batch.drop_column(name)
