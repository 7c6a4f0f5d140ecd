"""State and recovery: what survives a crash, a preemption or a bad batch.

checkpoint.py   Orbax checkpoints of the whole run state; resume and rollback
local.py        the local tier: each process's own shards, often, on its own host
tiers.py        which step, from which tier, every process restores
faults.py       numerical faults: which steps are faults, and what to do after a run of them
distributed.py  multi-process jobs: joining, the coordinator, a lost peer
"""
