"""jobs: durable batch generation on top of the swarm.

The batch core (this package):
    settings     Settings (SWARMBATCH_* environment) and get_settings()
    models       SQLAlchemy models: Job, Request (generated token ids = the checkpoint), ApiKey, DocumentSummary
    db, migrate  engines and sessions, the store's retry policy (retry_store); Alembic from code
    errors       the JobsError tree
    batch_input  OpenAI batch JSONL -> validated requests + per-line errors
    store        the verbs of the store: create, claim under lease, checkpoint, finish, cancel, expire, keys;
                 they never commit: the caller (route, worker step, CLI command) does
    submission   submit_batch: validate against the model, store, enqueue
    outputs      results / errors JSONL and the job object, in the OpenAI shapes
    runtime      Runtime: the collaborators of one process (settings, engine, Celery app, swarm clients)
    client       StoreClient / ApiClient: how the CLI reaches jobs
    progress     status lines and the live progress bar
    clock        now(): the scheduler's clock (the one thing tests fake)

Sub-packages:
    worker/      the Celery side: the app, the tasks, the batch worker, its runner, the sweep
    summaries/   the nightly summaries feature: schedule file, firing, documents, map-reduce, Markdown pages
    api/         the FastAPI app (REST)

Boundary: nothing here imports `servers`; jobs reach block servers only over the swarm (`swarmclient`).
"""
