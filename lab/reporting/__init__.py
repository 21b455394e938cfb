"""The lab's outputs: summary statistics, the text of reports, figures (matplotlib, Agg) and progress on
stderr."""
