"""netlab: several machines on one box for tests and benches (test plumbing, not product code).

Modules:
    lab    NetLab: N network namespaces on a private bridge (no route out), a per-node input delay, processes
           started inside a node (`ip netns exec`) and stopped by PID, everything torn down on exit; `unavailable()`
           says why a process cannot build one (not root, a tool missing)
    delay  the per-node delay program: an NFQUEUE reader (raw nfnetlink, stdlib only) that accepts each packet D ms
           after it arrived (this kernel has no `tc netem`)
"""
