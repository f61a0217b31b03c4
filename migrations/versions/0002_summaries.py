"""summarization: request document/stage/final, document_summaries

Revision ID: 0002_summaries
Revises: 0001_initial
Create Date: 2026-12-02 17:10:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002_summaries'
down_revision = '0001_initial'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('document', sa.String(length=1000), nullable=True))
        batch_op.add_column(sa.Column('stage', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('final', sa.Boolean(), nullable=False, server_default=sa.true()))
    op.create_table(
        'document_summaries',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('schedule', sa.String(length=200), nullable=False),
        sa.Column('document', sa.String(length=1000), nullable=False),
        sa.Column('content_sha', sa.String(length=64), nullable=False),
        sa.Column('model_id', sa.String(length=500), nullable=False),
        sa.Column('template_sha', sa.String(length=64), nullable=False),
        sa.Column('summary', sa.Text(), nullable=False),
        sa.Column('output_path', sa.String(length=2000), nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('summarized_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('schedule', 'document', name='uq_document_summaries_schedule_document'),
    )


def downgrade() -> None:
    op.drop_table('document_summaries')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('final')
        batch_op.drop_column('stage')
        batch_op.drop_column('document')
