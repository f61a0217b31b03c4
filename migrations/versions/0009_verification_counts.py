"""Checked outputs: per job, hop steps verified on a second server, mismatches found, and sampled steps unverified

Revision ID: 0009_verification_counts
Revises: 0008_idempotency_fingerprint
Create Date: 2026-12-10 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0009_verification_counts'
down_revision = '0008_idempotency_fingerprint'
branch_labels = None
depends_on = None

COLUMNS = ('steps_verified', 'verification_mismatches', 'steps_unverified')


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
