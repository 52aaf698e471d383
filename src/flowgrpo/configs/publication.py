"""The ``publication`` section: how a new weight version reaches the rollouts (the coordinator's
relay, services/coordinator/relay.py; the rollout checks the same stall range on every
``LoadWeightsRequest``, services/rollout/relay.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowgrpo.fields import knob

MAX_FANOUT = 64
MIN_STALL_S, MAX_STALL_S = 0.05, 300.0  # the rollout's range of LoadWeightsRequest.source_stall_s


@dataclass
class PublicationConfig:
    """How a new weight version reaches the rollouts.

    ``relay`` (default): a tree of fan-out ``relay_fanout`` over the rollouts; the trainer sends
    each byte at most ``relay_fanout`` times whatever the replica count (more only when relays
    fail). With at most ``relay_fanout`` rollouts it is the star. ``star``: every rollout fetches
    from the trainer (N copies through its link). Each relaying rollout keeps two versions in
    its bus store (``bus.max_bytes`` must hold them, else it loads but does not relay).
    """

    mode: Literal["relay", "star"] = "relay"
    # children per holder; k log_k(N) is flat from 2 to 4, 4 is shallower
    relay_fanout: int = knob(4, 1, 1024)
    # a holder that sends nothing this long is given up for the next
    relay_stall_s: float = knob(10.0, 0.001, 3600.0)

    def validate(self) -> None:
        if self.mode not in ("relay", "star"):
            raise ValueError(f"publication.mode={self.mode!r}: need 'relay' or 'star'")
        if not 1 <= self.relay_fanout <= MAX_FANOUT:
            raise ValueError(f"publication.relay_fanout={self.relay_fanout}: need 1..{MAX_FANOUT}")
        if not MIN_STALL_S <= self.relay_stall_s <= MAX_STALL_S:
            raise ValueError(
                f"publication.relay_stall_s={self.relay_stall_s:g}: need {MIN_STALL_S:g}..{MAX_STALL_S:g} s "
                "(longer than one bus request takes at the link's share: bus.max_request_bytes x fanout "
                "/ bandwidth)"
            )
