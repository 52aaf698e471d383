"""The reward service: scores images referenced on the data bus (``flowgrpo serve reward``)."""
