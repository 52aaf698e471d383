"""The coordinator: owner of a training run. It reads the prepared dataset, dispatches prompt
groups to rollout replicas, streams images to reward replicas, computes group advantages, drives
trainer steps and weight versions, and keeps the run state (torch-free)."""
