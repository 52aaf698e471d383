"""The trainer service: the policy (LoRA or the full gen path), the FlowGRPO loss, checkpoints and
the publication of new weights."""
