"""router API keys: router_keys, a projection of RouterKeyIssued / RouterKeyRevoked

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04 10:00:00
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('router_keys',
    sa.Column('key_id', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('expires_at_ns', sa.BigInteger(), nullable=True),
    sa.Column('rate_per_s', sa.Float(), nullable=True),
    sa.Column('burst', sa.Integer(), nullable=True),
    sa.Column('max_concurrent', sa.Integer(), nullable=True),
    sa.Column('issued_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('issued_by', sa.String(length=128), nullable=False),
    sa.Column('revoked_at_ns', sa.BigInteger(), nullable=True),
    sa.Column('revoked_by', sa.String(length=128), nullable=True),
    sa.Column('revoke_reason', sa.String(length=512), nullable=False),
    sa.Column('last_event_id', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('key_id', name=op.f('pk_router_keys'))
    )
    op.create_index(op.f('ix_router_keys_name'), 'router_keys', ['name'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_router_keys_name'), table_name='router_keys')
    op.drop_table('router_keys')
