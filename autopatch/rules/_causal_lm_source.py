"""Read a `*ForCausalLM.forward` and decide, from its syntax tree, whether the fused linear cross
entropy can stand in for `lm_head` + loss without changing any number.

The forward is accepted only when:
  - it calls `self.lm_head(...)` exactly once, as a top-level `NAME = <expr>` statement, and
    `self.loss_function(...)` exactly once, as `loss = self.loss_function(...)` at the top level or
    directly inside `if labels is not None:`, with the logits variable as its logits argument;
  - every statement between the two that mentions the logits variable (and whatever the lm_head
    statement does to the lm_head output) is one of the steps in LOGIT_STEPS, with every scaling
    step before every softcapping step (the kernel applies `logit_scale`, then the softcap);
  - after the loss call, the logits variable appears only in `return` statements or in the
    `output = (logits,) + ...` tuple of the old return_dict=False path.
Anything else — logits post-processing we do not recognise, a second lm_head call, a loss computed
on something other than the logits — leaves the class alone, with the reason.

The table is data: each step is a normalised source template (`ast.unparse` of the statement with
the logits variable renamed `logits`) in which `{A}` / `{C}` stand for an attribute path on the
model such as `self.config.logits_scaling` (multimodal heads: `self.config.get_text_config().x`, the
only call allowed in a path); the same placeholder must name the same path each time. A local alias of
such a path (`cap = self.config.x`, `if (cap := self.config.x) is not None:`) is read as the path, and
`getattr(<path>, "x", None)` as the path to an attribute that may be missing, which only a
"softcap when set" step may use (a missing one is then None: no softcap, as in the forward).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap

_LOGITS = "logits"


@dataclasses.dataclass(frozen=True)
class LogitStep:
    """One recognised transformation of the logits between lm_head and the loss."""

    name: str
    template: str  # normalised statement source; {A}: scale attribute, {C}: softcap attribute
    kind: str  # "none" | "scale_mul" | "scale_mul_if_set" | "scale_div" | "softcap" | "softcap_if_set"


# Templates are compared against `ast.unparse` output, so spacing and parentheses are canonical.
LOGIT_STEPS: tuple[LogitStep, ...] = (
    LogitStep("upcast", "logits = logits.float()", "none"),
    LogitStep("contiguous", "logits = logits.contiguous()", "none"),
    LogitStep("scale multiply", "logits = logits * {A}", "scale_mul"),
    LogitStep("scale divide", "logits = logits / {A}", "scale_div"),
    LogitStep("scale multiply when set", "if {A} is not None:\n    logits = logits * {A}", "scale_mul_if_set"),
    LogitStep("softcap", "logits = torch.tanh(logits / {C}) * {C}", "softcap"),
    LogitStep("softcap", "logits = nn.functional.tanh(logits / {C}) * {C}", "softcap"),
    LogitStep("softcap", "logits = torch.nn.functional.tanh(logits / {C}) * {C}", "softcap"),
    LogitStep("softcap", "logits = F.tanh(logits / {C}) * {C}", "softcap"),
    LogitStep(
        "softcap when set",
        "if {C} is not None:\n    logits = logits / {C}\n    logits = torch.tanh(logits)\n    logits = logits * {C}",
        "softcap_if_set",
    ),
    LogitStep(
        "softcap when set",
        "if {C} is not None:\n    logits = logits.float() / {C}\n    logits = torch.tanh(logits)\n    logits = logits * {C}",
        "softcap_if_set",
    ),
)

_ATTR_PATH = r"(self(?:\.(?:get_text_config\(\)|[A-Za-z_]\w*))+)"
TEXT_CONFIG_CALL = "get_text_config()"  # the one call a model attribute path may hold


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for slot in ("A", "C"):
        escaped = re.escape("{" + slot + "}")
        first = pattern.find(escaped)
        if first < 0:
            continue
        pattern = (
            pattern[:first]
            + f"(?P<{slot}>{_ATTR_PATH[1:-1]})"
            + pattern[first + len(escaped):].replace(escaped, f"(?P={slot})")
        )
    return re.compile(pattern + r"\Z")


_STEP_REGEX = [(step, _template_regex(step.template)) for step in LOGIT_STEPS]


@dataclasses.dataclass(frozen=True)
class Transform:
    """A recognised step with its attribute path resolved, e.g. scale_div of `config.logits_scaling`
    (the path is relative to the model: `self.` removed)."""

    kind: str
    attribute: str = ""
    optional: bool = False  # read as getattr(..., None): a missing attribute is None

    def describe(self) -> str:
        return self.kind if not self.attribute else f"{self.kind}({self.attribute})"


def resolve_attribute(model, path: str, optional: bool = False):
    """The value of a Transform's attribute path on `model` (`config.get_text_config().x` calls the
    config's get_text_config)."""
    value = model
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part == TEXT_CONFIG_CALL:
            value = value.get_text_config()
        elif optional and i == len(parts) - 1:
            value = getattr(value, part, None)
        else:
            value = getattr(value, part)
    return value


_NO_LOSS_CALL = "forward calls self.loss_function 0 times"  # the start of analyse_forward's reason for it


@dataclasses.dataclass(frozen=True)
class ForwardAnalysis:
    ok: bool
    reason: str = ""
    transforms: tuple[Transform, ...] = ()

    def variant(self) -> str:
        return "logits: " + (", ".join(t.describe() for t in self.transforms) or "plain lm_head")

    @property
    def computes_own_loss(self) -> bool:
        """The forward never calls self.loss_function (Bart-style decoders compute their own loss)."""
        return self.reason.startswith(_NO_LOSS_CALL)


def _is_self_call(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _calls(tree: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if _is_self_call(n, attr)]


def _contains(stmt: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(stmt))


def _mentions(stmt: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(stmt))


class _Rename(ast.NodeTransformer):
    """Rename the logits variable to `logits` and substitute local aliases of model attributes
    (`cap = self.config.logits_soft_cap`) by the attribute path itself."""

    def __init__(self, logits_name: str, aliases: dict[str, ast.expr], optional: set[str] | None = None):
        self.logits_name = logits_name
        self.aliases = aliases
        self.optional = optional if optional is not None else set()

    def visit_NamedExpr(self, node: ast.NamedExpr):
        # `if (cap := self.config.x) is not None:`: the alias for the body, the path in the test
        value = _alias_value(node.value, self.optional)
        if value is not None and isinstance(node.target, ast.Name):
            self.aliases[node.target.id] = value
            return value
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name):
        if node.id == self.logits_name:
            return ast.copy_location(ast.Name(id=_LOGITS, ctx=node.ctx), node)
        if node.id in self.aliases and isinstance(node.ctx, ast.Load):
            return ast.copy_location(self.aliases[node.id], node)
        return node


def _normalise(stmt: ast.stmt, logits_name: str, aliases: dict[str, ast.expr], optional: set[str] | None = None) -> str:
    import copy

    return ast.unparse(_Rename(logits_name, aliases, optional).visit(copy.deepcopy(stmt)))


def _alias_value(node: ast.AST, optional: set[str]) -> ast.expr | None:
    """What a local alias stands for: a model attribute path, or `getattr(<path>, "x", None)` read as
    `<path>.x` (recorded in `optional`); None for anything else."""
    if _is_attr_path(node):
        return node
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        and len(node.args) == 3 and not node.keywords
        and _is_attr_path(node.args[0])
        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
        and node.args[1].value.isidentifier()
        and isinstance(node.args[2], ast.Constant) and node.args[2].value is None
    ):
        value = ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Load())
        optional.add(ast.unparse(value)[len("self."):])
        return value
    return None


def _match_step(source: str) -> Transform | None:
    for step, regex in _STEP_REGEX:
        m = regex.match(source)
        if m is None:
            continue
        groups = m.groupdict()
        path = groups.get("A") or groups.get("C") or ""
        return Transform(step.kind, path[len("self."):] if path else "")
    return None


def _is_attr_path(node: ast.AST) -> bool:
    """`self.a.b`, with `get_text_config()` calls (no arguments) allowed along the way."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif (isinstance(node, ast.Call) and not node.args and not node.keywords
              and isinstance(node.func, ast.Attribute) and node.func.attr == TEXT_CONFIG_CALL[:-2]):
            node = node.func.value
        else:
            break
    return isinstance(node, ast.Name) and node.id == "self"


def forward_source_tree(forward) -> ast.FunctionDef:
    """The syntax tree of the undecorated forward function."""
    fn = inspect.unwrap(forward)
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    raise ValueError("no function definition in the forward's source")


@functools.lru_cache(maxsize=None)
def analyse_forward(forward) -> ForwardAnalysis:
    """Decide whether `forward` (a *ForCausalLM.forward) may run with the fused linear CE. Cached per
    function: the loss rule asks once per kernel and for the module's torch loss, and each answer
    parses the forward's source."""
    try:
        fn = forward_source_tree(forward)
    except (OSError, TypeError, SyntaxError, ValueError) as exc:
        return ForwardAnalysis(False, f"forward source unavailable ({type(exc).__name__}: {exc})")

    head_calls = _calls(fn, "lm_head")
    loss_calls = _calls(fn, "loss_function")
    # No loss_function call is said first, whatever the heads: computes_own_loss reads it (MusicGen
    # computes its own loss over several heads, self.lm_heads).
    if not loss_calls:
        return ForwardAnalysis(False, f"{_NO_LOSS_CALL} (need exactly 1)")
    if len(head_calls) != 1:
        return ForwardAnalysis(False, f"forward calls self.lm_head {len(head_calls)} times (need exactly 1)")
    if len(loss_calls) != 1:
        return ForwardAnalysis(False, f"forward calls self.loss_function {len(loss_calls)} times (need exactly 1)")
    head_call, loss_call = head_calls[0], loss_calls[0]

    body = fn.body
    head_at = next((i for i, s in enumerate(body) if _contains(s, head_call)), None)
    loss_at = next((i for i, s in enumerate(body) if _contains(s, loss_call)), None)
    if head_at is None or loss_at is None or loss_at <= head_at:
        return ForwardAnalysis(False, "self.loss_function is not called after self.lm_head in the forward's body")

    head_stmt = body[head_at]
    if not (
        isinstance(head_stmt, ast.Assign)
        and len(head_stmt.targets) == 1
        and isinstance(head_stmt.targets[0], ast.Name)
    ):
        return ForwardAnalysis(False, f"lm_head is not called in a plain assignment: {ast.unparse(head_stmt)!r}")
    logits_name = head_stmt.targets[0].id

    # The lm_head statement itself may transform the output (`self.lm_head(h).float()`,
    # `self.lm_head(h) * self.model.lm_head_multiplier`): read it as `logits = <that applied to logits>`.
    import copy

    rest = copy.deepcopy(head_stmt)
    inner = next(n for n in ast.walk(rest) if _is_self_call(n, "lm_head"))

    class _HeadToName(ast.NodeTransformer):
        def visit_Call(self, node):
            if node is inner:
                return ast.copy_location(ast.Name(id=logits_name, ctx=ast.Load()), node)
            return self.generic_visit(node)

    rest = _HeadToName().visit(rest)
    steps_src: list[str] = []
    aliases: dict[str, ast.expr] = {}
    optional: set[str] = set()  # attribute paths read through getattr(..., None)
    head_rest = _normalise(rest, logits_name, aliases, optional)
    if head_rest != f"{_LOGITS} = {_LOGITS}":
        steps_src.append(head_rest)

    # Statements between lm_head and the loss; when the loss sits inside `if labels is not None:`,
    # the statements of that block before the call too.
    loss_stmt_outer = body[loss_at]
    between = list(body[head_at + 1:loss_at])
    if isinstance(loss_stmt_outer, ast.If):
        if ast.unparse(loss_stmt_outer.test) != "labels is not None" or loss_stmt_outer.orelse:
            return ForwardAnalysis(
                False, f"the loss is guarded by {ast.unparse(loss_stmt_outer.test)!r}, not 'labels is not None'"
            )
        inner_at = next(i for i, s in enumerate(loss_stmt_outer.body) if _contains(s, loss_call))
        between += loss_stmt_outer.body[:inner_at]
        loss_stmt = loss_stmt_outer.body[inner_at]
        after = loss_stmt_outer.body[inner_at + 1:] + body[loss_at + 1:]
    else:
        loss_stmt = loss_stmt_outer
        after = body[loss_at + 1:]

    if not (
        isinstance(loss_stmt, ast.Assign)
        and len(loss_stmt.targets) == 1
        and isinstance(loss_stmt.targets[0], ast.Name)
        and loss_stmt.value is loss_call
    ):
        return ForwardAnalysis(False, f"the loss is not a plain `loss = self.loss_function(...)`: {ast.unparse(loss_stmt)!r}")
    logits_arg = loss_call.args[0] if loss_call.args else next(
        (k.value for k in loss_call.keywords if k.arg == "logits"), None
    )
    if not (isinstance(logits_arg, ast.Name) and logits_arg.id == logits_name):
        return ForwardAnalysis(False, f"self.loss_function is not given the lm_head output {logits_name!r} as logits")
    if not any(k.arg is None for k in loss_call.keywords):
        return ForwardAnalysis(False, "self.loss_function is not passed **kwargs (num_items_in_batch, shift_labels)")

    for stmt in between:
        if not _mentions(stmt, logits_name):
            # `cap = self.config.logits_soft_cap`: remember the alias for the steps that use it.
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                value = _alias_value(stmt.value, optional)
                if value is not None:
                    aliases[stmt.targets[0].id] = value
            continue
        steps_src.append(_normalise(stmt, logits_name, aliases, optional))

    transforms = []
    for src in steps_src:
        t = _match_step(src)
        if t is None:
            return ForwardAnalysis(False, f"unrecognised logits transformation: {src!r}")
        if t.attribute in optional:
            if t.kind != "softcap_if_set":
                return ForwardAnalysis(False, f"a logits {t.kind} reads an attribute that may be missing: {src!r}")
            t = dataclasses.replace(t, optional=True)
        if t.kind != "none":
            transforms.append(t)
    kinds = [t.kind for t in transforms]
    caps = [i for i, k in enumerate(kinds) if k.startswith("softcap")]
    scales = [i for i, k in enumerate(kinds) if k.startswith("scale")]
    if len(caps) > 1:
        return ForwardAnalysis(False, "more than one softcap applied to the logits")
    if caps and scales and max(scales) > caps[0]:
        return ForwardAnalysis(False, "logits scaled after the softcap (the kernel scales first)")

    for stmt in after:
        problem = _use_after_loss(stmt, logits_name)
        if problem:
            return ForwardAnalysis(False, f"logits used after the loss: {problem!r}")
    return ForwardAnalysis(True, transforms=tuple(transforms))


_TUPLE_OUTPUT = re.compile(r"output = \(logits,\) \+ ")


def _use_after_loss(stmt: ast.stmt, logits_name: str) -> str:
    """'' when `stmt` uses the logits only to return them, else the offending source."""
    if not _mentions(stmt, logits_name):
        return ""
    if isinstance(stmt, ast.Return):
        return ""
    if isinstance(stmt, ast.Assign) and _TUPLE_OUTPUT.match(_normalise(stmt, logits_name, {})):
        return ""
    if isinstance(stmt, ast.If) and not _mentions(stmt.test, logits_name):
        for inner in stmt.body + stmt.orelse:
            problem = _use_after_loss(inner, logits_name)
            if problem:
                return problem
        return ""
    return ast.unparse(stmt)


def lm_head_built_as_linear(cls) -> bool:
    """Whether some __init__ in the class's MRO assigns `self.lm_head = nn.Linear(...)`."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            return False
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Attribute) and t.attr == "lm_head"
                        and isinstance(t.value, ast.Name) and t.value.id == "self" for t in node.targets)
            ):
                value = node.value
                return (
                    isinstance(value, ast.Call)
                    and ast.unparse(value.func) in ("nn.Linear", "torch.nn.Linear", "Linear")
                )
        # this __init__ does not build lm_head; it may come from a base class's __init__
    return False
