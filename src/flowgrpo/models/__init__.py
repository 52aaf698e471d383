"""Model architectures in plain PyTorch. Package ``__init__`` files import nothing, so typed
configs (``flowgrpo.models.bagel.config``) load where torch is not installed."""
