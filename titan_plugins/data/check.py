"""The check the launcher runs before any rank starts (``DatasetSpec.check``,
``train/prelaunch.py``) for every streaming ``data.name``: text, jsonl, parquet, hf,
chat, chat_sample and mix. The top of the streaming data modules.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.data.chat_source import check_chat_source, sample_config
from titan_plugins.data.mix import chat_entry, entry_config, mix_entries
from titan_plugins.data.units import cfg_get, check_source


def check_data_source(data_cfg: Any) -> None:
    """Read a few bytes/rows of every file source of ``data_cfg`` (of each ``data.mix``
    entry for ``data.name=mix``, whose names and weights are checked first); a
    ConfigError in one line for a missing or empty file, a glob matching nothing, a
    missing text field, a file that is not UTF-8, a bad mix entry, a chat file without a
    row that trains (read until one does). Cheap: the
    launcher runs it before any rank starts (``DatasetSpec.check``, ``train/prelaunch.py``)."""
    if cfg_get(data_cfg, "name") == "chat_sample":
        return check_chat_source(sample_config(data_cfg), every_row=True)
    mix = cfg_get(data_cfg, "name") == "mix"
    if mix:
        configs = [cfg for cfg, _ in mix_entries(data_cfg)]
    else:
        configs = [entry_config(data_cfg, data_cfg)]
    for i, cfg in enumerate(configs):
        kind = cfg.name
        if kind == "chat":  # every_row: a chat file with no row that trains is one line here
            check_chat_source(chat_entry(data_cfg, cfg), every_row=True,
                              key=f"data.mix[{i}].path" if mix else "data.path")
            continue
        check_source(cfg)
