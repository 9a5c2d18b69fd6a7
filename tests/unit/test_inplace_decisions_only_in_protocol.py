"""`training.inplace.protocol` is the only place a recovery decision is taken.

The modules that carry decisions out (the host, the survivor, the spare, the standby node, a forming group,
a forked child) must not end a process with an exit code of their own: every code they return or exit with
comes from a `Decision` (`decision.exit_code`). This test reads their source (ast, nothing is imported) and
fails on any exit code spelled there: an integer literal returned or passed to `sys.exit`/`os._exit`/
`exit_now`, a module constant holding one, `ExitCode.X`, `PERMANENT`, or a signal death `128 + ...`.
What is genuinely no recovery decision is listed in `ALLOWED`, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "training" / "inplace"
MODULES = ("host.py", "survivor.py", "spare.py", "standby.py", "group.py", "forked.py")
EXIT_CALLS = {"exit", "_exit", "exit_now"}  # sys.exit, os._exit, training.fastexit.exit_now
CODE_NAMES = {"ExitCode", "PERMANENT", "RECOVERY_FAILED", "PASS_THROUGH"}

# (module, function) -> why the exit codes found in it are no recovery decision.
ALLOWED: dict[tuple[str, str], str] = {
    # A `Popen.returncode` written as an exit status (-N for a signal death is 128 + N): a translation of
    # what the kernel reported, which the host's policy then reads.
    ("host.py", "_status"): "the kernel's status as an exit code",
    # A promoted spare whose exit code was never published: the observation "it crashed" (SIGKILL), which
    # `decide_host` turns into a claim or a fall-back.
    ("host.py", "poll"): "an unpublished exit code observed as a SIGKILL death",
    # A forked child ends with what `training.entry.main` returned (1 when it raised): the child's own
    # role's code, the same as a fresh `python -m training` would exit with.
    ("forked.py", "_child"): "a forked child exits as `python -m training` would",
    # The standby stands in for torchrun's agent: a member's pod that should run torchrun after all is
    # told so with `JOIN` (no exit code: the caller then runs the agent).
    ("standby.py", "_carry_out"): "the JOIN sentinel (run torchrun), no exit code",
}


def _int_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to an integer literal (`JOIN = -1`)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_int_literal(node.value):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return found


def _is_int_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)


def _spells_a_code(node: ast.AST, constants: set[str]) -> str | None:
    """What in `node` (a returned value or an exit call's argument) is an exit code chosen here, if any."""
    for part in ast.walk(node):
        if _is_int_literal(part) and part is node:
            return f"the literal {ast.unparse(part)}"
        if isinstance(part, ast.Name) and (part.id in CODE_NAMES or part.id in constants) and part is node:
            return part.id
        if isinstance(part, ast.Name) and part.id in CODE_NAMES:
            return part.id
        if isinstance(part, ast.Attribute) and part.attr in CODE_NAMES:
            return ast.unparse(part)
        if isinstance(part, ast.BinOp) and any(
            isinstance(side, ast.Constant) and side.value == 128 for side in (part.left, part.right)
        ):
            return ast.unparse(part)
        if isinstance(part, ast.IfExp) and any(_is_int_literal(arm) for arm in (part.body, part.orelse)):
            return ast.unparse(part)
    return None


def _exit_codes(source: str) -> list[tuple[str, int, str]]:
    """(function, line, what) of every exit code `source` returns or exits with."""
    tree = ast.parse(source)
    constants = _int_constants(tree)
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            values: list[ast.AST] = []
            if isinstance(child, ast.Return) and child.value is not None:
                values.append(child.value)
            if isinstance(child, ast.Call):
                callee = child.func.attr if isinstance(child.func, ast.Attribute) else getattr(child.func, "id", "")
                if callee in EXIT_CALLS:
                    values.extend(child.args)
            if isinstance(child, ast.Assign | ast.AnnAssign) and child.value is not None:
                # `code = 1` feeding an exit later: named codes are caught where they are spelled.
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                if any(isinstance(t, ast.Name) and t.id in {"code", "exit_code", "status"} for t in targets):
                    values.append(child.value)
            for value in values:
                what = _spells_a_code(value, constants)
                if what is not None:
                    found.append((inner, child.lineno, what))
            visit(child, inner)

    visit(tree, "<module>")
    return found


@pytest.mark.parametrize("module", MODULES)
def test_exit_codes_come_only_from_decisions(module: str) -> None:
    found = _exit_codes((ROOT / module).read_text())
    chosen = [
        f"{module}:{line} in {function}: {what}" for function, line, what in found if (module, function) not in ALLOWED
    ]
    assert not chosen, "exit codes chosen outside training.inplace.protocol:\n" + "\n".join(chosen)


@pytest.mark.parametrize("module", MODULES)
def test_no_exit_code_is_even_named(module: str) -> None:
    """The exit codes' names (`ExitCode`, `PERMANENT`, ...) appear nowhere in these modules' code (their
    docstrings aside): what a code means to recovery is the protocol's."""
    tree = ast.parse((ROOT / module).read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    attrs = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not CODE_NAMES & (names | attrs | imported), module


def test_every_allowance_is_still_needed() -> None:
    """An allowance whose function no longer spells a code goes (the list only shrinks with the code)."""
    used = {(module, function) for module in MODULES for function, _, _ in _exit_codes((ROOT / module).read_text())}
    assert set(ALLOWED) <= used, sorted(set(ALLOWED) - used)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    return 0\n", ["f"]),
        ("def f():\n    return -1\n", ["f"]),
        ("import sys\ndef f():\n    sys.exit(3)\n", ["f"]),
        ("import os\ndef f():\n    os._exit(1)\n", ["f"]),
        ("def f(s):\n    return 128 + s[0]\n", ["f"]),
        ("def f():\n    return int(ExitCode.RECOVERY_FAILED)\n", ["f"]),
        ("JOIN = -1\ndef f():\n    return JOIN\n", ["f"]),
        ("def f(x):\n    return 0 if x else 1\n", ["f"]),
        ("def f(d):\n    return d.exit_code\n", []),
        ("def f():\n    return True\n", []),
        ("def f():\n    return 0.5\n", []),
        ("def f():\n    return None\n", []),
    ],
)
def test_the_check_sees_an_exit_code_however_it_is_spelled(source: str, expected: list[str]) -> None:
    assert [function for function, _, _ in _exit_codes(source)] == expected


def test_one_recovery_failed() -> None:
    """One `RecoveryFailed` (an in-place recovery giving up, `training.inplace.group`); the CLI's verdict on
    a run that ran out of restarts is `orchestrator.errors.RestartsExhausted`, a name of its own."""
    repo = ROOT.parents[1]
    defined = sorted(
        str(path.relative_to(repo))
        for package in ("training", "orchestrator")
        for path in (repo / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "RecoveryFailed"
    )
    assert defined == ["training/inplace/group.py"]
