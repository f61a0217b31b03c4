"""a job's kind, and a summary job's own state in summary_runs instead of the user's metadata

Revision ID: 0007_job_kind_and_summary_state
Revises: 0006_request_generated_count
Create Date: 2026-12-04 10:00:00

Before: a summary job kept its schedule, period, output folder, shape and documents in `jobs.metadata`, the
user's field, and the service trusted whatever that field held. After: `jobs.kind` says what a job is, and a
summary job's state lives in `summary_runs`. A row moves only if it is a job the schedules created: no API key,
the idempotency key `schedule:<schedule>:<period>`, and every key the firing wrote, of the right type; any
other job keeps its metadata as the user's, whatever keys it holds. Downgrade folds the state back into the
metadata (a failed page write's error and retry time are dropped).
"""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = '0007_job_kind_and_summary_state'
down_revision = '0006_request_generated_count'
branch_labels = None
depends_on = None

# the keys the firing wrote into the metadata, and their types
SUMMARY_KEYS: dict[str, type | tuple[type, ...]] = {
    'schedule': str, 'period': str, 'model_id': str, 'output': str, 'template_sha': str, 'summarize': dict,
    'documents': list, 'skipped': int}
WRITTEN_KEY = 'outputs_written'
# the old sweep still wrote the pages of a summary job cancelled or expired within a day: those stay due
OLD_LOOK_BACK = timedelta(days=1)

jobs = sa.table(
    'jobs', sa.column('id', sa.String), sa.column('api_key_id', sa.Integer), sa.column('kind', sa.String),
    sa.column('status', sa.String), sa.column('idempotency_key', sa.String), sa.column('metadata', sa.JSON),
    *(sa.column(f'{stamp}_at', sa.DateTime(timezone=True)) for stamp in ('completed', 'failed', 'cancelled', 'expired')))
summary_runs = sa.table(
    'summary_runs', sa.column('job_id', sa.String), sa.column('schedule', sa.String), sa.column('period', sa.String),
    sa.column('model_id', sa.String), sa.column('template_sha', sa.String), sa.column('output_dir', sa.String),
    sa.column('shape', sa.JSON), sa.column('documents', sa.JSON), sa.column('skipped', sa.Integer),
    sa.column('pages_written_at', sa.DateTime(timezone=True)), sa.column('pages_attempts', sa.Integer),
    sa.column('pages_retry_at', sa.DateTime(timezone=True)))


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=20), nullable=False, server_default='batch'))
    op.create_table(
        'summary_runs',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('schedule', sa.String(length=200), nullable=False),
        sa.Column('period', sa.String(length=100), nullable=False),
        sa.Column('model_id', sa.String(length=500), nullable=False),
        sa.Column('template_sha', sa.String(length=64), nullable=False),
        sa.Column('output_dir', sa.String(length=2000), nullable=False),
        sa.Column('shape', sa.JSON(), nullable=False),
        sa.Column('documents', sa.JSON(), nullable=False),
        sa.Column('skipped', sa.Integer(), nullable=False),
        sa.Column('pages_written_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('pages_attempts', sa.Integer(), nullable=False),
        sa.Column('pages_error', sa.Text(), nullable=True),
        sa.Column('pages_retry_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id'),
    )
    bind = op.get_bind()
    now = _now(bind)
    for row in bind.execute(sa.select(jobs).where(jobs.c.api_key_id.is_(None))).all():
        meta = dict(row.metadata or {})
        if not _fired_by_a_schedule(row.idempotency_key, meta):
            continue
        bind.execute(summary_runs.insert().values(
            job_id=row.id, schedule=meta['schedule'], period=meta['period'], model_id=meta['model_id'],
            template_sha=meta['template_sha'], output_dir=meta['output'], shape=meta['summarize'],
            documents=meta['documents'], skipped=meta['skipped'], pages_attempts=0,
            pages_written_at=(_ended_at(row) or now) if meta.get(WRITTEN_KEY) else None,
            pages_retry_at=now if not meta.get(WRITTEN_KEY) and _stopped_recently(row, now) else None))
        user = {key: value for key, value in meta.items() if key not in SUMMARY_KEYS and key != WRITTEN_KEY}
        bind.execute(jobs.update().where(jobs.c.id == row.id).values(kind='summary', metadata=user))


def downgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.select(summary_runs, jobs.c.metadata).join(jobs, jobs.c.id == summary_runs.c.job_id)).all()
    for row in rows:
        meta = {**(row.metadata or {}), 'schedule': row.schedule, 'period': row.period, 'model_id': row.model_id,
                'output': row.output_dir, 'template_sha': row.template_sha, 'summarize': row.shape,
                'documents': row.documents, 'skipped': row.skipped}
        if row.pages_written_at is not None:
            meta[WRITTEN_KEY] = True
        bind.execute(jobs.update().where(jobs.c.id == row.job_id).values(metadata=meta))
    op.drop_table('summary_runs')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('kind')


def _fired_by_a_schedule(idempotency_key: str | None, meta: dict[str, Any]) -> bool:
    """Whether the metadata is what a firing wrote: every key, of its type, and the firing's idempotency key."""
    if not all(isinstance(meta.get(key), kind) and not isinstance(meta.get(key), bool)
               for key, kind in SUMMARY_KEYS.items()):
        return False
    return idempotency_key == f"schedule:{meta['schedule']}:{meta['period']}"


def _ended_at(row: Any) -> datetime | None:
    return row.completed_at or row.failed_at or row.cancelled_at or row.expired_at


def _stopped_recently(row: Any, now: datetime) -> bool:
    stopped = row.cancelled_at if row.status == 'cancelled' else row.expired_at if row.status == 'expired' else None
    return stopped is not None and _comparable(stopped, now) >= now - OLD_LOOK_BACK


def _now(bind: sa.engine.Connection) -> datetime:
    """Now, as the column type stores it: naive UTC on SQLite (what jobs.models.UTCDateTime writes), aware elsewhere."""
    now = datetime.now(UTC)
    return now.replace(tzinfo=None) if bind.dialect.name == 'sqlite' else now


def _comparable(value: datetime, now: datetime) -> datetime:
    return value.replace(tzinfo=None) if now.tzinfo is None else value
