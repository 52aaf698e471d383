"""The vLLM-Omni rollout engine (``rollout.engine=vllm_omni``).

- ``request``: what one sample needs, as plain values that ride in vLLM-Omni's ``extra_args``
  (imports neither torch nor vLLM);
- ``pipeline``: runs INSIDE vLLM-Omni's diffusion worker: BAGEL's pipeline with this project's
  sampler math as its scheduler, prompt ids passed through, noise by coordinates, and the worker
  extension that loads policy updates;
- ``engine``: :class:`~flowgrpo.services.rollout.omni.engine.VllmOmniBagelEngine`, the
  ``RolloutEngine`` the rollout service drives.

docs/rollout-engines.md says when to choose it and what was verified where.
"""
