"""commands: the `swarmbatch` command line, one module per group of verbs; the top-level `cli.py` composes them.

    errors   ExitCode (each code documented once) and ErrorBoundary, the root group that turns our errors into
             one line on stderr and an exit code
    options  what several modules share: --initial-peers, --json, --verbose, --swarm-file, a client's --identity
    swarm    model prepare / tiny, dht, serve, swarm status, generate, demo; swarm init / new-key / add-member /
             remove-member / members
    batch    submit, status, results, cancel, jobs
    admin    worker, beat, api, db upgrade, keys create / list / revoke, schedules list / run

Heavy imports (torch, hivemind, the jobs store) stay inside the command bodies, so `--help` starts fast.
"""
