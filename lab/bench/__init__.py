"""`pfec bench ...`: benchmarks of the real code paths (codec, transport, quantisers, fuzz, flood,
break-even, scheduler); each writes docs/benchmarks/."""
