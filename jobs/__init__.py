"""jobs: durable batch generation on top of the swarm.

Modules:
    settings     Settings (SWARMBATCH_* environment) and get_settings()
    models       SQLAlchemy models: Job, Request (generated token ids = the checkpoint), ApiKey, DocumentSummary
    db, migrate  engines and sessions; Alembic from code
    batch_input  OpenAI batch JSONL -> validated requests + per-line errors
    store        the verbs of the store: create, claim under lease, checkpoint, finish, cancel, expire, keys
    submission   submit_batch: validate against the model, store, enqueue
    runner       BatchRunner: a claimed batch as pipelined micro-batches (lanes), finished rows replaced at once
                 by newly claimed ones; commits every K tokens; resumes from committed ids
    worker       JobWorker (one batch of one job) and sweep_store (lost leases, deadlines, finalization)
    celery_app   make_celery(settings): Redis or the embedded SQLite broker
    tasks        the Celery tasks: process_job, sweep, fire_schedules
    clock        now(): the scheduler's clock (the one thing tests fake)
    schedules    the schedules TOML file: Schedule (cron + timezone, source, prompt, output), due periods
    documents    a schedule's documents (glob of .txt/.md, or JSONL) with content hashes
    scheduling   firing: one job per schedule and period (SQL idempotency key), unchanged documents skipped
    mapreduce    documents -> requests that fit the context: chunks, then stages of summaries of summaries
    summary_outputs  a finished schedule job's Markdown files and index, written atomically; skip state
    runtime      Runtime: the composition root of a process
    outputs      results / errors JSONL and the job object, in the OpenAI shapes
    client       StoreClient / ApiClient: how the CLI reaches jobs
    progress     status lines and the live progress bar
    api/         the FastAPI app (REST)
    local_worker start_local_worker: a worker child process with this process's settings (demo, tests)
    demo         `swarmbatch demo`: the embedded main job
    errors       the JobsError tree
"""
