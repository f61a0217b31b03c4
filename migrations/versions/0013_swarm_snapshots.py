"""The web view's swarm page: swarm_snapshots, what a worker last saw of each model's swarm (its coverage map)

Revision ID: 0013_swarm_snapshots
Revises: 0012_request_prompt_count
Create Date: 2026-12-05 14:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0013_swarm_snapshots'
down_revision = '0012_request_prompt_count'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'swarm_snapshots',
        sa.Column('model', sa.String(length=500), nullable=False),
        sa.Column('worker', sa.String(length=200), nullable=False),
        sa.Column('taken_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('report', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('model'),
    )


def downgrade() -> None:
    op.drop_table('swarm_snapshots')
