"""Nightly summaries: a folder of documents summarized on a schedule, as ordinary batch jobs.

    schedule_file  the operator's schedules TOML: Schedule (cron + timezone, source, prompt, output), due periods
    firing         one job per schedule and period (SQL idempotency key), unchanged documents skipped
    documents      a schedule's documents (glob of .txt/.md, or JSONL) with content hashes
    mapreduce      documents -> requests that fit the context: chunks, then stages of summaries of summaries
    pages          a finished schedule job's Markdown pages and index, written atomically (a failing folder is
                   retried, then recorded on the job for the sweep); skip state
"""
