"""The worker side of jobs: what a Celery worker process runs.

    celery_app    make_worker_celery(runtime): the core's app (jobs.queue) with the tasks and the maintenance step,
                  carrying the process's Runtime (runtime_of)
    tasks         the Celery tasks: process_job, sweep, fire_schedules (thin: load, call, enqueue next)
    job_worker    JobWorker: claim a batch of one job under a lease, run it, record the outcome (job transitions
                  through runtime.lifecycle), with its checked-output counts (docs/security.md "Checked outputs"); each store
                  step one transaction, retried through a database blip (jobs.db.retry_store)
    sizing        the batch a worker takes on: claim and lanes from what the chain can hold for one caller (records,
                  and each server's `info` answer for the cache it may take now),
                  the job's next requests and a fair share among live workers (PipelinePlan)
    runner        BatchRunner: a claimed batch as pipelined micro-batches (lanes) started as the servers' cache
                  allows, finished rows replaced at once by newly claimed ones, rows without room waiting (leases
                  renewed); commits every K tokens (with checked outputs, the tokens whose window's checks
                  passed); resumes from committed ids
    embedder      EmbeddingRunner: a claimed batch of /v1/embeddings requests, one stateless forward per micro-batch,
                  each micro-batch's vectors stored as completed at once
    sweep         sweep_store: lost leases back to pending, overdue jobs expired, finished jobs settled, failed
                  end hooks retried; each job in its own transaction
    swarm_view    the swarm snapshot a worker publishes (coverage map + its round trips) at most every
                  swarm_snapshot_seconds, for the API's swarm page (jobs.snapshots)
    maintenance   the worker bootstep that heartbeats and sends the sweep every interval (no beat needed)
"""
