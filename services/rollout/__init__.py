"""The rollout service: a BAGEL sampler behind gRPC, trajectories and images on the data bus."""
