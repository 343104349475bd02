"""Warm trial starts (det_local/sched/warm/, trial/zygote.py): zygotes, for root and for users."""
