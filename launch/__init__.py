"""launch: composition roots that start real processes on this machine (above jobs, servers and swarmclient;
below `commands/`, which they never import).

    ready         the ready lines that `swarmbatch serve` prints and launchers wait for ("Serving blocks ..."); no
                  dependencies, so tests read it without typer or the CLI
    processes     ManagedProcess (a child in its own process group, stopped by PID), cli_command, exit_on_sigterm
    local_swarm   LocalSwarm: a DHT node and block servers on 127.0.0.1 (demo, tests, benches)
    local_worker  start_local_worker: a `swarmbatch worker` child with this process's settings (demo, tests)
    embedded      embedded_stack: a local swarm of one model and a worker on the embedded store (demo, run)
    errors        LaunchError / ProcessNotReady / RunInterrupted
    demo          `swarmbatch demo`: the embedded main job, on sample_documents/ (package data)
    batch_run     `swarmbatch run FILE`: a user's batch file on the embedded stack; resumes an interrupted run
"""
