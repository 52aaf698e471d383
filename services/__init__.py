"""The four services, installed as ``flowgrpo.services.<role>`` (see docs/ARCHITECTURE.md)."""
