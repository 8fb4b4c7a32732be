"""``reward_model``: a Hugging Face sequence-classification folder as a reward, scored as
TRL 1.16's GRPOTrainer scores a reward model (``_calculate_rewards``).

Each (prompt, completion) pair becomes one text: for conversational prompts the reward
tokenizer's chat template over ``prompt + completion`` messages, for plain ones
``prompt + completion``; the texts are tokenized without special tokens, right-padded,
not truncated (TRL truncates nothing there), and the reward is ``logits[:, 0]``. As TRL,
a tokenizer without a pad token pads with its EOS, and the model's ``pad_token_id`` is set
to the tokenizer's (the head reads the last token that is not padding).

Options (``+objective.reward_options.reward_model.KEY=VALUE``): ``path`` (the folder,
required), ``dtype`` (``float32``), ``device`` (the rank's own under ``objective=grpo``),
``batch_size`` (pairs per forward), ``chat_template_kwargs`` (as TRL's GRPOConfig's).
The model and its tokenizer load once per process, on the first call; ``check_options``
refuses a bad folder or option before launch. Needs ``transformers``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["check_options", "reward_model", "reward_texts"]

DTYPES = ("float32", "bfloat16", "float16")
OPTIONS = ("path", "dtype", "device", "batch_size", "chat_template_kwargs")
HOW = "+objective.reward_options.reward_model.path=FOLDER (a Hugging Face sequence-classification model)"


def _num_labels(config: Mapping[str, Any]) -> int:
    """As transformers reads config.json: ``id2label``'s size, else ``num_labels``, else 2."""
    if config.get("id2label"):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def check_options(options: Mapping[str, Any]) -> None:
    """Before launch: the folder holds a one-label sequence-classification model and the
    options are known and valid. Raises ValueError (one line)."""
    stray = sorted(set(options) - set(OPTIONS))
    if stray:
        raise ValueError(f"{stray[0]!r} is not an option of reward_model (options: {', '.join(OPTIONS)})")
    path = options.get("path")
    if not path:
        raise ValueError(f"no path: set {HOW}")
    config_file = Path(str(path)) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"path={path} is not a folder with a config.json; set {HOW}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"path={path}: config.json does not parse ({exc})") from None
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        # a causal LM loaded as a classifier gets a random head: every reward would be noise
        raise ValueError(f"path={path}: config.json's architectures {architectures} hold no sequence-classification "
                         "model (...ForSequenceClassification), whose head scores a text")
    labels = _num_labels(config)
    if labels != 1:
        raise ValueError(f"path={path}: the model has num_labels={labels}; a reward model has one label "
                         "(its logit is the reward)")
    dtype = str(options.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype}: expected one of {', '.join(DTYPES)}")
    batch_size = options.get("batch_size", 32)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected a whole number of pairs per forward, at least 1")
    template_kwargs = options.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs={template_kwargs!r}: expected a mapping of the chat template's "
                         "variables (e.g. enable_thinking: false)")
    device = options.get("device")
    if device is not None:
        import torch

        try:
            torch.device(str(device))
        except RuntimeError:
            raise ValueError(f"device={device}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("needs transformers to load the folder (pip install transformers)") from None


@functools.cache
def _load(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """The model (eval mode, no gradients) and its tokenizer, once per process."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # TRL's fallback
        tokenizer.pad_token = tokenizer.eos_token
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=getattr(torch, dtype), output_loading_info=True)
    missing = info.get("missing_keys") or []
    if missing:  # e.g. no trained score head: a random one would score noise
        raise ValueError(f"{path} lacks weights the model needs: {', '.join(sorted(missing)[:3])}"
                         + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""))
    # the head reads each row's last token that is not padding
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval().requires_grad_(False), tokenizer


def _is_conversational(prompt: Any) -> bool:
    """TRL's ``is_conversational``: a list of messages with roles."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def reward_texts(prompts: list[Any], completions: list[Any], tokenizer: Any,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The text the reward model reads for each pair, as TRL builds it (the first prompt
    decides whether the batch is conversational, as in TRL)."""
    if _is_conversational(prompts[0]):
        kwargs = dict(chat_template_kwargs or {})
        return [tokenizer.apply_chat_template(p + c, tools=None, tokenize=False, **kwargs)
                for p, c in zip(prompts, completions, strict=True)]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def _default_device() -> str:
    """``parallelism.device=auto``'s rule; under ``objective=grpo`` the rank's device is bound instead."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def reward_model(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], *,
                 path: str | None = None, dtype: str = "float32", device: str | None = None, batch_size: int = 32,
                 chat_template_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> list[float]:
    """The reward model's score (``logits[:, 0]``) of each prompt + completion (module
    docstring); option ``path`` names a Hugging Face sequence-classification folder."""
    import torch

    if not path:
        raise ValueError(f"no path: set {HOW}")
    if not completions:
        return []
    model, tokenizer = _load(str(path), str(dtype), str(device or _default_device()))
    texts = reward_texts(prompts, completions, tokenizer, chat_template_kwargs)
    out: list[float] = []
    for start in range(0, len(texts), int(batch_size)):
        inputs = tokenizer(text=texts[start:start + int(batch_size)], return_tensors="pt", padding=True,
                           padding_side="right", add_special_tokens=False).to(model.device)
        with torch.inference_mode():
            # TRL stores the scores in a float32 table: the same rounding for bf16/fp16 models
            out.extend(model(**inputs).logits[:, 0].float().tolist())
    return out


reward_model.check_options = check_options  # called with the options when the job is prepared
