"""Training engines over one step (``trainer.core``): ``single`` (one process), ``distributed`` (torch.distributed
PP x FSDP2 x EP x TP) and ``deepspeed`` (transformers + ZeRO), the rank entry points of their ``torchrun``
jobs, and the layout planner."""
