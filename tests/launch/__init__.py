"""Launchers (det_local/launch/): torch_distributed, deepspeed, horovod, multinode, DDP."""
