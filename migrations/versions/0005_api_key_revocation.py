"""api_keys: revoked_at (`swarmbatch keys revoke`)

Revision ID: 0005_api_key_revocation
Revises: 0004_worker_maintenance
Create Date: 2026-12-04 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005_api_key_revocation'
down_revision = '0004_worker_maintenance'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # forgets revocations: a revoked key authenticates again under code of 0004 (its jobs keep the row alive)
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('revoked_at')
