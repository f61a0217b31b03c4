"""workers maintain the store themselves: worker heartbeats, maintenance slots, a job's dispatch hold

Revision ID: 0004_worker_maintenance
Revises: 0003_drop_request_resumes
Create Date: 2026-12-03 16:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0004_worker_maintenance'
down_revision = '0003_drop_request_resumes'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'worker_heartbeats',
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'maintenance_slots',
        sa.Column('name', sa.String(length=40), nullable=False),
        sa.Column('next_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('dispatch_after', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('dispatch_after')
    op.drop_table('maintenance_slots')
    op.drop_table('worker_heartbeats')
