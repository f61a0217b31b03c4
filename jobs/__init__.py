"""jobs: durable batch generation on top of the swarm.

The batch core (this package):
    settings     Settings (SWARMBATCH_* environment) and get_settings()
    models       SQLAlchemy models: Job (with its kind), Request (generated token ids = the checkpoint), ApiKey,
                 SummaryRun, DocumentSummary, WorkerHeartbeat, MaintenanceSlot, SwarmSnapshot
    db, migrate  engines and sessions, the store's retry policy (retry_store); Alembic from code
    errors       the JobsError tree
    batch_input  OpenAI batch JSONL -> validated requests + per-line errors (naming the parameter at fault)
    files        the Files API's store: uploads as SQL chunks; a job's output/error files, rendered from its requests
    store        the verbs of the store: create, claim under lease, checkpoint, finish, cancel or expire
                 requests, keys (revoke); they never commit: the caller (route, worker step, CLI command) does
    liveness     worker heartbeats and the maintenance slot (one sweep per interval across all workers)
    snapshots    swarm snapshots: what the workers last saw of each model's swarm, for the API's swarm page
    lifecycle    Lifecycle: the one owner of job transitions (start, settle, finalize, cancel, expire), running
                 each job kind's hooks (JobHooks) on every path; Runtime.lifecycle registers them
    submission   submit_batch: validate against the model (and the user's metadata), store, enqueue (idempotency
                 keys; a failed enqueue is left to the sweep)
    outputs      results / errors JSONL and the batch object, in the OpenAI shapes
    runtime      Runtime: the collaborators of one process (settings, engine, Celery app, lifecycle, swarm clients)
    client       StoreClient / ApiClient: how the CLI reaches jobs
    progress     status lines and the live progress bar
    clock        now(): the scheduler's clock (the one thing tests fake)

Sub-packages:
    worker/      the Celery side: the app, the tasks, the batch worker, its runner, the sweep, the maintenance tick
    summaries/   the nightly summaries feature: schedule file, firing, documents, map-reduce, Markdown pages
    api/         the FastAPI app (REST), its offline /docs and the web view at /ui/

Boundary: nothing here imports `servers`; jobs reach block servers only over the swarm (`swarmclient`).
"""
