"""What a causal LM's ``forward`` does to the logits after its head, run exactly.

Some architectures change the head's output before the loss: Cohere multiplies by
``logit_scale``, Granite divides by ``logits_scaling``, Gemma 2/3 soft-cap, Falcon-H1
multiplies by ``lm_head_multiplier``. Rather than a list of such families, the
statements are read from the class's own ``forward`` (between the head's call and the
loss) and compiled into a function run on the wrapper's head output, in the class's
module namespace: the numbers are transformers' own. A model with such work takes the
whole-logits loss (the fused loss would skip it). Statements that read anything but
``self`` and the logits cannot be moved: one line naming the line of code.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn

from titan_plugins.errors import ConfigError

__all__ = ["post_head", "pre_head"]


def _calls_head(node: ast.AST, head: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == head
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "self" for n in ast.walk(node))


class _HeadToLogits(ast.NodeTransformer):
    def __init__(self, head: str) -> None:
        self.head = head

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if _calls_head(node, self.head) and isinstance(node.func, ast.Attribute) and node.func.attr == self.head:
            return ast.Name(id="logits", ctx=ast.Load())
        return self.generic_visit(node)


def _names_read(statements: list[ast.stmt]) -> set[str]:
    return {n.id for s in statements for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def post_head(shell: nn.Module, head: str) -> Callable[[Any], Any] | None:
    """``fn(logits) -> logits`` doing what ``type(shell).forward`` does after
    ``self.<head>(...)``, or ``None`` when it does nothing to them."""
    cls = type(shell)
    forward = inspect.unwrap(cls.forward)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        raise ConfigError(f"model=hf: {cls.__name__}.forward has no readable source; cannot tell what it does "
                          "after its head") from None
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    start = next((i for i, s in enumerate(body) if _calls_head(s, head)), None)
    if start is None:
        raise ConfigError(f"model=hf: {cls.__name__}.forward never calls self.{head}; cannot find its logits")
    first = body[start]
    plain = (isinstance(first, ast.Assign) and isinstance(first.value, ast.Call)
             and _calls_head(first.value, head) and len(first.targets) == 1
             and isinstance(first.targets[0], ast.Name) and first.targets[0].id == "logits")
    tail: list[ast.stmt] = []
    for statement in body[start + 1:]:  # up to the loss (or the return)
        if isinstance(statement, ast.Return) or "loss" in _names_read([statement]) or any(
                isinstance(t, ast.Name) and t.id == "loss" for n in ast.walk(statement)
                if isinstance(n, ast.Assign) for t in n.targets):
            break
        tail.append(statement)
    if plain and not tail:
        return None
    first = _HeadToLogits(head).visit(first)
    statements = [first, *tail]
    unknown = _names_read(statements) - {"self", "logits"} - set(vars(inspect.getmodule(cls))) - set(dir(builtins))
    if unknown:
        line = forward.__code__.co_firstlineno + statements[-1].lineno - 1
        raise ConfigError(f"model=hf: {cls.__name__}.forward changes its logits after self.{head} using "
                          f"{', '.join(sorted(unknown))} (line {line}); model=hf cannot apply that exactly")
    return bind_statements(shell, statements, "logits", "logits", f"after self.{head}")


def _plain(node: ast.AST) -> bool:
    """A name, an attribute / subscript of one, or a dtype cast of those (``.to(...)``: the
    precision policy's business): taking the hidden states, not work on them."""
    while isinstance(node, (ast.Attribute, ast.Subscript)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"):
        node = node.func.value if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name)


def pre_head(shell: nn.Module, head: str) -> Callable[[Any], Any] | None:
    """``fn(h) -> h`` doing what ``type(shell).forward`` does to the base model's hidden
    states before ``self.<head>(...)`` (MiniCPM3 divides them by ``logits_scaling``; some
    cast them to the head's dtype), or ``None`` when it does nothing to them. The fused
    loss keeps it: the deferred head takes what the wrapper hands it."""
    cls = type(shell)
    module = inspect.getmodule(cls)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return None
    start = next((i for i, s in enumerate(body) if _calls_head(s, head)), None)
    if start is None:
        return None
    allowed = {"self", "hidden_states"} | set(vars(module)) | set(dir(builtins))
    work: list[ast.stmt] = [s for s in body[:start] if isinstance(s, ast.Assign) and len(s.targets) == 1
                            and isinstance(s.targets[0], ast.Name) and s.targets[0].id == "hidden_states"
                            and not _plain(s.value) and "hidden_states" in _names_read([s])
                            and _names_read([s]) <= allowed]
    call = next(n for n in ast.walk(body[start]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == head)
    arg = call.args[0] if call.args else None
    if arg is not None and not _plain(arg) and _names_read([ast.Expr(arg)]) <= allowed:  # self.lm_head(h.to(...))
        work.append(ast.Assign(targets=[ast.Name(id="hidden_states", ctx=ast.Store())], value=arg))
    if not work:
        return None
    return bind_statements(shell, work, "hidden_states", "hidden_states", f"before self.{head}")


def bind_statements(owner: nn.Module, statements: list[ast.stmt], value: str, returns: str,
                    label: str) -> Callable[[Any], Any]:
    """``fn(x)``: ``statements`` of ``type(owner).forward`` run as a function of ``value``
    (bound to ``x``) returning ``returns``, with ``self`` = ``owner``, in the class's
    module namespace (the class's own names resolve as in its forward)."""
    cls = type(owner)
    fn = ast.FunctionDef(name="_bound", args=ast.arguments(
        posonlyargs=[], args=[ast.arg("self"), ast.arg(value)], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[*statements, ast.Return(ast.Name(id=returns, ctx=ast.Load()))], decorator_list=[], type_params=[])
    tree = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    namespace = dict(vars(inspect.getmodule(cls)))
    exec(compile(tree, f"<{cls.__name__}.forward {label}>", "exec"), namespace)  # noqa: S102
    compiled = namespace["_bound"]
    return lambda x: compiled(owner, x)
