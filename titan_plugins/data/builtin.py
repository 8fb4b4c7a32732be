"""The core's datasets, registered like any plugin's (a built-in plugin).

Light on purpose: builders are ``"module:function"`` strings, so listing
plugins imports neither torch nor numpy.
"""

from __future__ import annotations

from typing import Any

from titan_plugins.hookspecs import hookimpl
from titan_plugins.spec import DatasetSpec

_SOURCES = "titan_plugins.data.sources"
_CHECK = "titan_plugins.data.check:check_data_source"  # before launch
DATASETS = (
    DatasetSpec(
        name="builtin",
        build=f"{_SOURCES}:build_builtin",
        description="the Python language reference (~0.5 MB, shipped), pre-tokenized",
    ),
    DatasetSpec(
        name="synthetic",
        build=f"{_SOURCES}:build_synthetic",
        description="random tokens, deterministic per seed (benchmarks)",
    ),
    DatasetSpec(
        name="text",
        build=f"{_SOURCES}:build_text",
        check=_CHECK,
        description="a local .txt file or a directory of them (data.path)",
    ),
    DatasetSpec(
        name="jsonl",
        build=f"{_SOURCES}:build_jsonl",
        check=_CHECK,
        description="local JSONL (data.path), text in data.text_field",
    ),
    DatasetSpec(
        name="hf",
        build=f"{_SOURCES}:build_hf",
        check=_CHECK,
        description="a local Hugging Face dataset (data.path, data.split), offline",
    ),
    DatasetSpec(
        name="parquet",
        build=f"{_SOURCES}:build_parquet",
        check=_CHECK,
        description="local Parquet (data.path), text in data.text_field (the parquet extra)",
    ),
    DatasetSpec(
        name="chat",
        build="titan_plugins.data.chat_source:build_chat",
        check=_CHECK,
        description="conversations (data.path: JSONL, Parquet or a save_to_disk folder) "
        "through the chat template; assistant-only loss, packed (data.chat.*)",
    ),
    DatasetSpec(
        name="chat_sample",
        build="titan_plugins.data.chat_source:build_chat_sample",
        check=_CHECK,
        description="a few hundred synthetic conversations (shipped), ChatML, as data.name=chat",
    ),
    DatasetSpec(
        name="preference",
        build="titan_plugins.data.preference_source:build_preference",
        check="titan_plugins.data.preference_source:check_preference",
        description="preference pairs (data.path: JSONL, Parquet or a save_to_disk folder; TRL's "
        "prompt/chosen/rejected layouts) through the chat template, for objective=dpo (data.preference.*)",
    ),
    DatasetSpec(
        name="preference_sample",
        build="titan_plugins.data.preference_source:build_preference_sample",
        check="titan_plugins.data.preference_source:check_preference_sample",
        description="300 synthetic preference pairs (shipped), ChatML, as data.name=preference",
    ),
    DatasetSpec(
        name="prompts",
        build="titan_plugins.data.prompt_source:build_prompts",
        check="titan_plugins.data.prompt_source:check_prompts",
        description="prompt-only rows for objective=grpo (data.path: JSONL, Parquet or a save_to_disk folder; "
        "TRL's prompt messages or string, other columns to the rewards; default the shipped arithmetic task)",
    ),
    DatasetSpec(
        name="mix",
        build=f"{_SOURCES}:build_mix",
        check=_CHECK,
        description="data.mix: several text/jsonl/parquet/hf sources mixed by weight",
    ),
)


@hookimpl
def titan_register_datasets(register: Any) -> None:
    for spec in DATASETS:
        register(spec)
