"""The application layer, imported as ``flowgrpo.services`` (through the link
src/flowgrpo/services): the four services (``coordinator``, ``rollout``, ``reward``,
``trainer``), the ``flowgrpo`` command (``cli``) and the benchmarks (``bench``). The library in
src/flowgrpo never imports it (docs/ARCHITECTURE.md, "Package layout")."""
