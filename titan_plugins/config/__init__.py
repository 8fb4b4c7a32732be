"""Config schemas (``schema``) and the Hydra glue (``hydra_glue``)."""
