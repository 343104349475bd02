"""The daemon (det_local/sched/): its components, the queue and policy, slots, recovery, plans."""
