"""Nightly summaries: a folder of documents summarized on a schedule, as ordinary batch jobs.

    schedule_file  the operator's schedules TOML: Schedule (cron + timezone, source, prompt, output), due periods
    firing         one job per schedule and period (SQL idempotency key), unchanged documents skipped
    documents      a schedule's documents (glob of .txt/.md, or JSONL) with content hashes
    mapreduce      documents -> requests that fit the context: chunks, then stages of summaries of summaries
    pages          an ended summary job's Markdown pages and index, written atomically, once; skip state; a
                   failed write recorded and retried (bounded)
    hooks          SummaryHooks: the feature in the job lifecycle (next map-reduce stage; pages when the job ends)

A summary job is a Job of kind `summary`; its own state (schedule, period, output folder, shape, documents,
pages) is its SummaryRun row, never the user's metadata.
"""
