"""What a base model's ``forward`` does to the embeddings before its first layer, run
exactly: Granite multiplies by ``embedding_multiplier``, Phi applies its embedding
dropout. The statements are the class's own (``forward``'s top-level assignments to
``inputs_embeds`` / ``hidden_states`` between the embedding and the layer loop that
read nothing but those, ``self`` and the module's names), compiled into a function on
the base model, the way ``titan_hf.head`` does for the head. Anything else the base
forward computes there (positions, masks, rotary) the wrapper makes itself; what it
does not make (an ALiBi bias, say) ``model.verify`` catches.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["embed_work"]

_VARS = {"inputs_embeds", "hidden_states"}


def _reads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _is_work(statement: ast.stmt, allowed: set[str]) -> bool:
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id in _VARS):
        return False
    value = statement.value
    if isinstance(value, ast.Name):  # hidden_states = inputs_embeds: an alias, not work
        return False
    return bool(_reads(value) & _VARS) and _reads(value) <= allowed


def embed_work(base: nn.Module) -> Callable[[Any], Any] | None:
    """``fn(h) -> h`` doing what ``type(base).forward`` does between its embedding and
    its layers, or ``None`` when it does nothing to them."""
    cls = type(base)
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
    except (OSError, TypeError):
        return None
    module = inspect.getmodule(cls)
    allowed = _VARS | {"self"} | set(vars(module)) | set(dir(builtins))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    work: list[ast.stmt] = []
    for statement in body:
        if isinstance(statement, ast.For):  # the layer loop: the embeddings' part is over
            break
        if _is_work(statement, allowed):
            work.append(statement)
    if not work:
        return None
    # one name for the running value: both variables are the hidden states here
    lines = [ast.Assign(targets=[ast.Name(id="inputs_embeds", ctx=ast.Store())], value=ast.Name(id="h", ctx=ast.Load())),
             ast.Assign(targets=[ast.Name(id="hidden_states", ctx=ast.Store())], value=ast.Name(id="h", ctx=ast.Load()))]
    for statement in work:
        target = statement.targets[0].id  # type: ignore[attr-defined]
        other = "hidden_states" if target == "inputs_embeds" else "inputs_embeds"
        lines += [statement, ast.Assign(targets=[ast.Name(id=other, ctx=ast.Store())],
                                        value=ast.Name(id=target, ctx=ast.Load()))]
    from titan_hf.head import bind_statements

    return bind_statements(base, lines, "h", "hidden_states", "before its layers")
