"""The sender's measuring rate controller, ``PathRate`` (sans-IO), after BBR's model (draft-ietf-ccwg-bbr)
with the changes a deadline stream needs. It plugs into the seam in :mod:`pfec.sender.transport.rate`.

Each part is a module that owns its state and its constants (after aioquic's ``quic/congestion/``):

- ``rtt``: min RTT, smoothed RTT, the recent floor, the queues a round saw;
- ``delivery``: one delivery-rate sample per round, the max filter's estimate, the random-loss floor;
- ``phases``: STARTUP, DRAIN and CRUISE, their transitions in one table;
- ``caps``: the two in-flight caps;
- ``congestion``: loss above the random floor while a queue stands cuts the estimate;
- ``forecast``: the cautious rate the session plans on (after Sprout);
- ``breaker``: the circuit breaker (RFC 8084);
- ``controller``: ``PathRate``, which composes them and takes the session's reports.
"""

from pfec.sender.transport.path_rate.controller import PathRate
from pfec.sender.transport.path_rate.phases import Phase

__all__ = ["PathRate", "Phase"]
