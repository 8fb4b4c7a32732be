"""Building blocks the first-party models share (import the submodules directly)."""
