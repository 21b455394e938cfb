"""The sending end of one handoff, sans-IO (bytes and ``now`` in; datagrams, timers and events out):
the session's state machine and the parts it delegates to (ACK intake and path estimates, what is in
flight, the send path and repair planning, split bookkeeping, the rate controller's seam), and
``transfer``, the one place a session is assembled. The daemon beside this package is its asyncio adapter."""
