"""State and recovery: what survives a crash, a preemption or a bad batch.

checkpoint.py   Orbax checkpoints of the whole run state; resume and rollback
faults.py       numerical faults: which steps are faults, and what to do after a run of them
distributed.py  multi-process jobs: joining, the coordinator, a lost peer
"""
