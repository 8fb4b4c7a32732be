"""Config schemas (``schema``) and the Hydra glue: ``options``, ``store``,
``compose`` and ``hydra_errors``, re-exported together by ``hydra_glue``."""
