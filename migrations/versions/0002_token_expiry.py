"""api tokens expire and can be rotated: api_tokens.expires_at, api_tokens.rotated_at

Tokens issued before this revision never expired; they get ``expires_at`` = the time of the
upgrade plus 30 days (the default lifetime): a grace period to rotate them, not a lockout.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 13:50:00
"""
from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Lifetime given to the tokens that existed before expiry did.
GRACE = timedelta(days=30)


def upgrade() -> None:
    with op.batch_alter_table('api_tokens') as t:
        t.add_column(sa.Column('expires_at', sa.DateTime(), nullable=True))
        t.add_column(sa.Column('rotated_at', sa.DateTime(), nullable=True))
    # Naive UTC, like every local row time (the app's UTCDateTime).
    until = (datetime.now(timezone.utc) + GRACE).replace(tzinfo=None)
    op.execute(sa.text("UPDATE api_tokens SET expires_at = :until WHERE expires_at IS NULL").bindparams(until=until))
    with op.batch_alter_table('api_tokens') as t:
        t.alter_column('expires_at', existing_type=sa.DateTime(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('api_tokens') as t:
        t.drop_column('rotated_at')
        t.drop_column('expires_at')
