"""requests: generated_count = len(generated_ids), and an index on (status, generated_count) that covers /metrics

Revision ID: 0006_request_generated_count
Revises: 0005_api_key_revocation
Create Date: 2026-12-04 10:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006_request_generated_count'
down_revision = '0005_api_key_revocation'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('generated_count', sa.Integer(), nullable=False, server_default='0'))
    # the rows that exist: json_array_length is in SQLite and PostgreSQL alike
    op.execute("UPDATE requests SET generated_count = json_array_length(generated_ids) "
               "WHERE json_array_length(generated_ids) > 0")
    op.create_index('ix_requests_status_generated_count', 'requests', ['status', 'generated_count'])


def downgrade() -> None:
    op.drop_index('ix_requests_status_generated_count', table_name='requests')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('generated_count')
