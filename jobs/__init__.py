"""jobs: durable batch generation on top of the swarm.

Modules:
    settings   Settings (SWARMBATCH_* environment) and get_settings()
    demo       `swarmbatch demo`: the embedded main job
"""
