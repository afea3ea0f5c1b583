"""admin store: audit projection, workers, pools, configs, tokens, replay jobs

Tables: see control_plane/admin/db/models.py. Times of local rows are naive UTC DateTime (the
app's UTCDateTime decorator); event times are BIGINT unix nanoseconds. JSON is JSONB on
PostgreSQL.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 22:25:20.169278
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('salt', sa.String(length=64), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('revoked_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('name', name=op.f('uq_api_tokens_name'))
    )
    op.create_table('audit_events',
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.Column('type', sa.String(length=64), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=512), nullable=False),
    sa.Column('producer', sa.String(length=256), nullable=False),
    sa.Column('epoch', sa.BigInteger(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('request_id', sa.String(length=256), nullable=True),
    sa.Column('worker_id', sa.String(length=256), nullable=True),
    sa.Column('pool', sa.String(length=128), nullable=True),
    sa.Column('decision_id', sa.String(length=128), nullable=True),
    sa.Column('occurred_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('topic', sa.String(length=256), nullable=False),
    sa.Column('kafka_partition', sa.Integer(), nullable=False),
    sa.Column('kafka_offset', sa.BigInteger(), nullable=False),
    sa.Column('payload', JSON, nullable=False),
    sa.PrimaryKeyConstraint('event_id', name=op.f('pk_audit_events'))
    )
    op.create_index(op.f('ix_audit_events_decision_id'), 'audit_events', ['decision_id'], unique=False)
    op.create_index(op.f('ix_audit_events_occurred_at_ns'), 'audit_events', ['occurred_at_ns'], unique=False)
    op.create_index(op.f('ix_audit_events_pool'), 'audit_events', ['pool'], unique=False)
    op.create_index('ix_audit_events_position', 'audit_events', ['topic', 'kafka_partition', 'kafka_offset'], unique=False)
    op.create_index(op.f('ix_audit_events_request_id'), 'audit_events', ['request_id'], unique=False)
    op.create_index(op.f('ix_audit_events_type'), 'audit_events', ['type'], unique=False)
    op.create_index(op.f('ix_audit_events_worker_id'), 'audit_events', ['worker_id'], unique=False)
    op.create_table('audit_positions',
    sa.Column('topic', sa.String(length=256), nullable=False),
    sa.Column('kafka_partition', sa.Integer(), nullable=False),
    sa.Column('next_offset', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('topic', 'kafka_partition', name=op.f('pk_audit_positions'))
    )
    op.create_table('planner_configs',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('config', JSON, nullable=False),
    sa.Column('created_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('actor_role', sa.String(length=16), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_planner_configs'))
    )
    op.create_table('pools',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('ttft_slo_ms', sa.Float(), nullable=True),
    sa.Column('itl_slo_ms', sa.Float(), nullable=True),
    sa.Column('min_replicas', sa.Integer(), nullable=False),
    sa.Column('max_replicas', sa.Integer(), nullable=False),
    sa.Column('gpus_per_replica', sa.Integer(), nullable=False),
    sa.Column('gpu_budget', sa.Integer(), nullable=True),
    sa.Column('pinned_replicas', sa.Integer(), nullable=True),
    sa.Column('pin_reason', sa.String(length=512), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('updated_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('updated_by', sa.String(length=128), nullable=False),
    sa.Column('last_event_id', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_pools'))
    )
    op.create_table('replay_jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('params', JSON, nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('progress', sa.Float(), nullable=False),
    sa.Column('stage', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_replay_jobs'))
    )
    op.create_index(op.f('ix_replay_jobs_created_at'), 'replay_jobs', ['created_at'], unique=False)
    op.create_index(op.f('ix_replay_jobs_status'), 'replay_jobs', ['status'], unique=False)
    op.create_table('router_configs',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('config', JSON, nullable=False),
    sa.Column('created_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('actor_role', sa.String(length=16), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_router_configs'))
    )
    op.create_table('worker_incarnations',
    sa.Column('worker_id', sa.String(length=256), nullable=False),
    sa.Column('epoch', sa.BigInteger(), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('endpoint', sa.String(length=512), nullable=False),
    sa.Column('registered_at_ns', sa.BigInteger(), nullable=True),
    sa.Column('draining_at_ns', sa.BigInteger(), nullable=True),
    sa.Column('deregistered_at_ns', sa.BigInteger(), nullable=True),
    sa.Column('reason', sa.String(length=512), nullable=False),
    sa.PrimaryKeyConstraint('worker_id', 'epoch', name=op.f('pk_worker_incarnations'))
    )
    op.create_table('workers',
    sa.Column('worker_id', sa.String(length=256), nullable=False),
    sa.Column('epoch', sa.BigInteger(), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('endpoint', sa.String(length=512), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('capacity', JSON, nullable=False),
    sa.Column('block_size', sa.Integer(), nullable=False),
    sa.Column('hash_algo', sa.String(length=64), nullable=False),
    sa.Column('running', sa.Integer(), nullable=False),
    sa.Column('waiting', sa.Integer(), nullable=False),
    sa.Column('queued_prefill_tokens', sa.BigInteger(), nullable=False),
    sa.Column('active_decode_blocks', sa.BigInteger(), nullable=False),
    sa.Column('tier_usage', JSON, nullable=False),
    sa.Column('registered_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('reported_at_ns', sa.BigInteger(), nullable=False),
    sa.Column('drain_requested_at_ns', sa.BigInteger(), nullable=True),
    sa.Column('drain_requested_by', sa.String(length=128), nullable=True),
    sa.Column('routed', sa.BigInteger(), nullable=False),
    sa.Column('completed', sa.BigInteger(), nullable=False),
    sa.Column('failed', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('worker_id', name=op.f('pk_workers'))
    )
    op.create_index(op.f('ix_workers_pool'), 'workers', ['pool'], unique=False)
    op.create_table('replay_results',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('summary', JSON, nullable=False),
    sa.Column('detail', JSON, nullable=False),
    sa.Column('plot_png', sa.LargeBinary(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['replay_jobs.id'], name=op.f('fk_replay_results_job_id_replay_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_replay_results'))
    )


def downgrade() -> None:
    op.drop_table('replay_results')
    op.drop_index(op.f('ix_workers_pool'), table_name='workers')
    op.drop_table('workers')
    op.drop_table('worker_incarnations')
    op.drop_table('router_configs')
    op.drop_index(op.f('ix_replay_jobs_status'), table_name='replay_jobs')
    op.drop_index(op.f('ix_replay_jobs_created_at'), table_name='replay_jobs')
    op.drop_table('replay_jobs')
    op.drop_table('pools')
    op.drop_table('planner_configs')
    op.drop_table('audit_positions')
    op.drop_index(op.f('ix_audit_events_worker_id'), table_name='audit_events')
    op.drop_index(op.f('ix_audit_events_type'), table_name='audit_events')
    op.drop_index(op.f('ix_audit_events_request_id'), table_name='audit_events')
    op.drop_index('ix_audit_events_position', table_name='audit_events')
    op.drop_index(op.f('ix_audit_events_pool'), table_name='audit_events')
    op.drop_index(op.f('ix_audit_events_occurred_at_ns'), table_name='audit_events')
    op.drop_index(op.f('ix_audit_events_decision_id'), table_name='audit_events')
    op.drop_table('audit_events')
    op.drop_table('api_tokens')
