"""Fan-out commands (issue 37): the simulator's fan-out body and `pfec bench fanout`."""
