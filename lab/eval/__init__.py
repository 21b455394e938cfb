"""`pfec eval`: the paper's experiments on this code base (sweep, grid, task, precision, overhead stages),
their configuration and their report (CSV/JSON, figures, docs/RESULTS.md)."""
