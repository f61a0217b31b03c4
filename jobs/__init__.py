"""jobs: durable batch generation on top of the swarm.

The batch core (this package):
    settings     Settings (SWARMBATCH_* environment) and get_settings()
    models       SQLAlchemy models: Job (with its kind), Request (generated token ids = the checkpoint), ApiKey,
                 SummaryRun, DocumentSummary, WorkerHeartbeat, MaintenanceSlot, SwarmSnapshot
    db, migrate  engines and sessions, the store's retry policy (retry_store); Alembic from code
    errors       the JobsError tree
    input_lines  a batch file's lines streamed from byte pieces (numbered, UTF-8), the whole-file limits
    batch_input  OpenAI batch JSONL -> validated requests + per-line errors (naming the parameter at fault)
    line_checks  LineProblem and what line checks share; chat messages (developer role, text parts)
    line_sampling  a line's sampling parameters: OpenAI's defaults, drawn seeds, penalties, vLLM's extensions
    line_embeddings  a /v1/embeddings line: inputs as token ids (one request each), encoding_format, dimensions
    line_responses   a /v1/responses line, translated into the chat line it amounts to and checked by the chat path
    line_format  a chat line's response_format (json_object, json_schema): checked, and its output's grammar
    files        the Files API's store: uploads as SQL chunks; a job's output/error files, rendered from its requests
    store        the verbs of the store: create, claim under lease, checkpoint, finish, cancel or expire
                 requests, keys (revoke); they never commit: the caller (route, worker step, CLI command) does
    liveness     worker heartbeats and the maintenance slot (one sweep per interval across all workers)
    snapshots    swarm snapshots: what the workers last saw of each model's swarm, for the API's swarm page
    lifecycle    Lifecycle: the one owner of job transitions (start, settle, finalize, cancel, expire), running
                 each job kind's hooks (JobHooks) on every path; Runtime.lifecycle registers them
    queue        the task names, the Celery app that sends them (Redis or the embedded SQLite broker), enqueue_job
    durations    '24h', '90m', '3600s' -> seconds (completion windows, schedules' grace)
    ingest       a REST submission's lines checked by a worker off the request: streamed from the stored file,
                 stored in commits with a fenced cursor (resumable, exactly once); whole-file failures
    submission   submit_batch (lines checked first: CLI, demo) and submit_unchecked (REST: a worker checks them,
                 jobs.ingest): store, enqueue (idempotency keys; a failed enqueue is left to the sweep)
    outputs      results / errors JSONL and the batch object, in the OpenAI shapes (chat, completions, Responses
                 objects, embeddings lists)
    runtime      Runtime: the collaborators of one process (settings, engine, Celery app, lifecycle, swarm clients),
                 given each job kind's hooks and the Celery app to build
    backends     StoreBackend / ApiBackend: how the CLI reaches jobs (straight through the store, or over REST)
    progress     status lines and the live progress bar
    clock        now(): the scheduler's clock (the one thing tests fake)

Sub-packages (above the core; the core imports none of them):
    worker/      the Celery side: the worker's app, the tasks, the job worker, its runner, the sweep, the maintenance tick
    summaries/   the nightly summaries feature: schedule file, firing, documents, map-reduce, Markdown pages
    api/         the FastAPI app (REST), its offline /docs and the web view at /ui/

On top of them all:
    assembly     build_runtime(settings): the core wired with every job kind's hooks and the worker's Celery app;
                 get_runtime() / set_runtime(), this process's runtime (entry points, benches and tests build here)

Boundary: nothing here imports `servers`; jobs reach block servers only over the swarm (`swarmclient`).
tests/test_layers.py checks the core, the assembly and the boundary.
"""
