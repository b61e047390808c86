"""Tools for finished runs (comparison tables, plots, reading W&B's offline files back). Nothing in the
training path imports this package."""
