"""OpenAI drop-in: the Files API (files, file_chunks), a job's input/output/error file ids, `queued` -> `validating`,
a request's choice (n choices of one line are n requests) and its logprobs (asked, and generated)

Revision ID: 0011_openai_files
Revises: 0010_job_pipeline
Create Date: 2026-12-03 20:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0011_openai_files'
down_revision = '0010_job_pipeline'
branch_labels = None
depends_on = None

FILE_COLUMNS = ('input_file_id', 'output_file_id', 'error_file_id')


def upgrade() -> None:
    op.create_table(
        'files',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('api_key_id', sa.Integer(), nullable=True),
        sa.Column('purpose', sa.Enum('batch', 'batch_output', name='filepurpose', native_enum=False,
                                     create_constraint=False, length=20), nullable=False),
        sa.Column('filename', sa.String(length=500), nullable=False),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=True),
        sa.Column('lines', sa.String(length=10), nullable=True),
        sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id']),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_files_api_key_created', 'files', ['api_key_id', 'created_at'])
    op.create_table(
        'file_chunks',
        sa.Column('file_id', sa.String(length=40), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(['file_id'], ['files.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('file_id', 'seq'),
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        for name in FILE_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.String(length=40), nullable=True))
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('choice', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('top_logprobs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('generated_logprobs', sa.JSON(), nullable=True))
        batch_op.drop_constraint('uq_requests_job_custom_id', type_='unique')
        batch_op.create_unique_constraint('uq_requests_job_custom_id_choice', ['job_id', 'custom_id', 'choice'])
    # OpenAI's first status: a stored job waits for its first claim as `validating` (there is no `queued`)
    op.execute("UPDATE jobs SET status = 'validating' WHERE status = 'queued'")


def downgrade() -> None:
    op.execute("UPDATE jobs SET status = 'queued' WHERE status = 'validating'")
    op.execute("DELETE FROM requests WHERE choice > 0")  # a line's further choices have no place in the old schema
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_constraint('uq_requests_job_custom_id_choice', type_='unique')
        batch_op.create_unique_constraint('uq_requests_job_custom_id', ['job_id', 'custom_id'])
        batch_op.drop_column('generated_logprobs')
        batch_op.drop_column('top_logprobs')
        batch_op.drop_column('choice')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        for name in reversed(FILE_COLUMNS):
            batch_op.drop_column(name)
    op.drop_table('file_chunks')
    op.drop_index('ix_files_api_key_created', table_name='files')
    op.drop_table('files')
