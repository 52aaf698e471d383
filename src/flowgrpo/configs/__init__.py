"""The run's config, torch-free, that every process reads (as prime-rl's config package):
``run`` (``RunConfig``: the whole job; the coordinator's own sections: model, data, sampling,
advantages, schedule, launch, logger), and the sections a service also takes on its own with
``flowgrpo serve ROLE``: ``rollout``, ``reward``, ``trainer``, plus ``publication``.
``flowgrpo.config`` builds them from recipes and overrides. Services import their config from
here; the coordinator imports no service module but the in-process launcher's."""
