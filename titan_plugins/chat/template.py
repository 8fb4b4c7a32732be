"""Chat templates: found in a model folder, a file or the package, rendered as transformers does.

Where a template comes from (``load_chat_template(spec, tokenizer_dir)``):

- ``spec`` None: the folder's own, as ``AutoTokenizer`` finds it: ``chat_template.jinja``
  first, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
  ``{"name", "template"}`` of which ``default`` is taken).
- ``spec`` a path to a file: that file's text.
- ``spec`` a name: one of the folder's named templates (``tool_use``, from the list form
  or ``additional_chat_templates/NAME.jinja``), else a shipped one (``SHIPPED``:
  ``chatml``).

Rendering copies ``transformers.utils.chat_template_utils``: a jinja2
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension and the ``{% generation %}`` tag, the ``raise_exception`` and
``strftime_now`` globals, a ``tojson`` that does not escape HTML, the special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) as variables, ``None``-valued
message keys dropped and ``reasoning_content`` filled from ``thinking``/``reasoning``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from titan_plugins.errors import ConfigError

TEMPLATES = Path(__file__).parent / "templates"
SHIPPED = ("chatml",)
# transformers' SPECIAL_TOKENS_ATTRIBUTES: passed to every template that names them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TRACKING: ContextVar[list | None] = ContextVar("titan_chat_generation", default=None)


class ChatTemplate:
    """A compiled chat template and the variables it is rendered with.

    ``source``: the jinja text; ``origin``: where it came from (for messages);
    ``variables``: special tokens and any extra template variables (``enable_thinking``).
    """

    def __init__(self, source: str, *, origin: str = "<string>",
                 variables: Mapping[str, Any] | None = None) -> None:
        self.source = source
        self.origin = origin
        self.variables = dict(variables or {})
        self._compiled = _compile(source, origin)
        self._cache: dict[str, Any] = {}  # what encode measures once per template

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r})"

    def __getstate__(self) -> dict[str, Any]:  # picklable (loader workers): recompiled
        return {"source": self.source, "origin": self.origin, "variables": self.variables}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], origin=state["origin"], variables=state["variables"])

    @property
    def has_generation_tags(self) -> bool:
        """The template marks assistant text with ``{% generation %}`` blocks."""
        return _GENERATION_RE.search(self.source) is not None

    def with_variables(self, **variables: Any) -> ChatTemplate:
        """A copy rendered with these extra variables too (e.g. ``enable_thinking=False``)."""
        return ChatTemplate(self.source, origin=self.origin, variables={**self.variables, **variables})

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = False,
               tools: Sequence[Mapping] | None = None) -> str:
        """The conversation as the template writes it (``apply_chat_template(..., tokenize=False)``).

        A template that fails (``raise_exception``, an undefined attribute, a type error)
        raises ``ConfigError`` naming the template and the reason in one line.
        """
        return self.render_spans(messages, add_generation_prompt=add_generation_prompt,
                                 tools=tools, track=False)[0]

    def render_spans(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = False,
                     tools: Sequence[Mapping] | None = None, track: bool = True,
                     ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its ``{% generation %}`` blocks."""
        chat = _normalize(messages)
        spans: list[tuple[int, int]] = []
        blocks: list[str] = []
        token = _TRACKING.set([blocks, spans] if track else None)
        try:
            for block in self._compiled.generate(
                messages=chat, tools=_plain(list(tools)) if tools is not None else None,
                documents=None, add_generation_prompt=add_generation_prompt,
                **_plain(self.variables),
            ):
                blocks.append(block)
        except ConfigError:
            raise
        except Exception as exc:  # jinja2 errors, and Python errors raised inside filters
            why = (str(exc).strip() or type(exc).__name__).splitlines()[0]
            raise ConfigError(f"chat template {self.origin}: failed to render: {why}") from None
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), spans


def load_chat_template(spec: str | None, tokenizer_dir: str | Path | None,
                       *, key: str = "data.chat.template") -> ChatTemplate:
    """The template ``spec`` names (None: the folder's own) with the folder's special tokens.

    ``tokenizer_dir`` is a model/tokenizer folder or a ``tokenizer.json`` inside one (its
    folder is used), or None. No template anywhere is a ``ConfigError`` naming ``key``.
    """
    folder = _folder(tokenizer_dir)
    config = _tokenizer_config(folder)
    variables = _special_tokens(config)
    named = _folder_templates(folder, config) if folder else {}
    where = f"{key}={spec!r}" if spec is not None else key
    if spec is None:
        if "default" in named:
            source, origin = named["default"]
            return ChatTemplate(source, origin=origin, variables=variables)
        place = f"{folder}" if folder else "no tokenizer folder"
        raise ConfigError(
            f"{key}: the tokenizer has no chat template ({place}: no chat_template.jinja and no "
            f"chat_template in tokenizer_config.json); name one: {key}=FILE or one of "
            f"{', '.join(SHIPPED)}"
        )
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read it ({exc})") from None
        return ChatTemplate(text, origin=str(path), variables=variables)
    if spec in named:
        source, origin = named[spec]
        return ChatTemplate(source, origin=origin, variables=variables)
    if spec in SHIPPED:
        shipped = TEMPLATES / f"{spec}.jinja"
        return ChatTemplate(shipped.read_text(encoding="utf-8"), origin=f"shipped:{spec}",
                            variables=variables)
    choices = [*(n for n in named if n != "default"), *SHIPPED]
    raise ConfigError(
        f"{where}: no such file and not a template name (names: {', '.join(choices)})"
    )


# ------------------------------------------------------------------ folders
def _folder(tokenizer_dir: str | Path | None) -> Path | None:
    if tokenizer_dir is None:
        return None
    p = Path(tokenizer_dir).expanduser()
    if p.is_file():
        p = p.parent
    return p if p.is_dir() else None


def _tokenizer_config(folder: Path | None) -> dict[str, Any]:
    if folder is None or not (folder / "tokenizer_config.json").is_file():
        return {}
    file = folder / "tokenizer_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):  # the AddedToken form
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _folder_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """name -> (source, origin), with transformers' precedence (the .jinja file wins)."""
    named: dict[str, tuple[str, str]] = {}
    cfg_file = folder / "tokenizer_config.json"
    value = config.get("chat_template")
    if isinstance(value, str):
        named["default"] = (value, f"{cfg_file}:chat_template")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and isinstance(item.get("name"), str) \
                    and isinstance(item.get("template"), str):
                named[item["name"]] = (item["template"], f"{cfg_file}:chat_template[{item['name']}]")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            named[file.stem] = (file.read_text(encoding="utf-8"), str(file))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        named["default"] = (jinja.read_text(encoding="utf-8"), str(jinja))
    return named


# ------------------------------------------------------------------ rendering
def _normalize(messages: Sequence[Mapping]) -> list[dict]:
    """transformers' ``_normalize_chat_messages`` + ``_alias_reasoning_fields``."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(_plain(msg))
    return out


def _plain(value: Any) -> Any:
    """Plain JSON types only, as transformers hands the sandbox (tuples kept)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=32)
def _compile(source: str, origin: str) -> Any:
    try:
        return _environment().from_string(source)
    except Exception as exc:  # jinja2.TemplateSyntaxError and friends
        line = getattr(exc, "lineno", None)
        at = f" (line {line})" if line else ""
        why = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ConfigError(f"chat template {origin}: not a valid jinja template{at}: {why}") from None


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records the block's character span."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation", [], [], None, None)
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context: Any, caller: Any) -> str:
            rv = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own trick)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
