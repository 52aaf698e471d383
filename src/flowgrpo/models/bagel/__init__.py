"""BAGEL-7B-MoT for text-to-image.

- ``config``: ``BagelConfig`` / ``VAEConfig`` / ``SpecialTokens`` and presets (no torch needed)
- ``model``: ``BagelModel`` (MoT decoder + generation heads), ``KVCache``, latent packing helpers
- ``vae``: the FLUX autoencoder
- ``checkpoint``: load / save the published folder layout, ``make_tiny_bagel``
"""
