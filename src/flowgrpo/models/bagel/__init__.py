"""BAGEL-7B-MoT for text-to-image.

- ``config``: ``BagelConfig`` / ``VAEConfig`` / ``SpecialTokens`` and presets (no torch needed)
- ``model``: ``BagelModel`` (MoT decoder + generation heads), latent packing helpers
- ``attention``: the masked joint attention, ``KVCache`` and the image query's fast path over it
- ``parallelize``: ``parallelize_bagel`` (compile, activation checkpointing, FSDP2), from outside
- ``vae``: the FLUX autoencoder
- ``checkpoint``: load / save the published folder layout, ``make_tiny_bagel``
"""
