"""The run's config sections that more than one process reads (torch-free); ``flowgrpo.config``
builds them from recipes and overrides."""
