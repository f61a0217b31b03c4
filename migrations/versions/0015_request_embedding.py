"""requests: embedding, the vector of a /v1/embeddings request (float32, little-endian bytes)

Revision ID: 0015_request_embedding
Revises: 0014_retention
Create Date: 2026-12-05 21:20:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015_request_embedding'
down_revision = '0014_retention'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('embedding', sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('embedding')
