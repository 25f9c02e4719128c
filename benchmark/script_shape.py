"""The shape of the scripts, as a reader meets it: lines of each script, of its `main`, its `Args` and its actor
function (a Sebulba script's `actor_loop`, the Anakin script's `rollout`; `rollout` in revisions before the rename),
its functions over 60 lines (methods and nested functions too), the names it imports from cleanrl_utils, its lines
over 100 and over 110 characters, its code lines over 100 (docstrings and comment lines left out) and its packed lines
(`packed_lines`); the `diff | wc -l` of the script pairs that should differ only by their algorithm, the lines it
changes (`diff | grep -c '^[<>]'`) and those after the first `def` (the imports, flags and their checks left out); and
the lines of each cleanrl_utils module. tests/test_house_rules.py holds the code to its `packed_lines`,
`function_lengths` and `definitions`.

usage (repository root): uv run python benchmark/script_shape.py [--rev REV] [--packed]
  (default: the working tree; --packed lists each script's packed lines)
"""

import ast
import io
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

from cleanrl_utils.cli import fail, run_cli

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "ppo": "cleanba_ppo_envpool_impala_atari_wrapper.py",
    "impala": "cleanba_impala_envpool_impala_atari_wrapper.py",
    "mujoco_ppo": "cleanba_ppo_continuous_action_envpool_mujoco.py",
    "sac": "cleanba_sac_continuous_action_envpool_mujoco.py",
    "r2d2": "cleanba_r2d2_envpool_impala_atari_wrapper.py",
    "muzero": "cleanba_muzero_envpool_impala_atari_wrapper.py",
    "ppo_anakin": "cleanba_ppo_anakin.py",
    "onpolicy": "cleanba_onpolicy_continuous_action_envpool_mujoco.py",
    "ppo_anakin_continuous": "cleanba_ppo_continuous_action_anakin.py",
    "pqn": "cleanba_pqn_envpool_impala_atari_wrapper.py",
}
PAIRS = [
    ("ppo", "impala"),
    ("ppo", "mujoco_ppo"),
    ("mujoco_ppo", "sac"),
    ("sac", "r2d2"),
    ("sac", "muzero"),
    ("ppo", "ppo_anakin"),
    ("mujoco_ppo", "onpolicy"),
    ("ppo_anakin", "ppo_anakin_continuous"),
    ("mujoco_ppo", "ppo_anakin_continuous"),
    ("ppo", "pqn"),
]


def read(path: str, rev: str | None) -> str:
    if rev is None:
        return (REPO / path).read_text()
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True)
    if shown.returncode != 0:  # an unknown revision, or one without this script
        fail(f"--rev {rev}: {(shown.stderr.strip().splitlines() or ['git show failed'])[-1]}")
    return shown.stdout


# what a packed line holds, read off the syntax tree: see `packed_lines`
SIMPLE_VALUES = (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Starred)
BLOCKS = (ast.FunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try)
LONG = 100  # characters: a line this long holds one thing, without a comment beside it


def call_depth(node: ast.AST) -> int:
    """How deep calls nest in `node`: f(x) 1, f(g(x)) 2."""
    inner = max((call_depth(child) for child in ast.iter_child_nodes(node)), default=0)
    return inner + isinstance(node, ast.Call)


def packed_lines(source: str) -> dict[int, str]:
    """The lines that hold what reads better as two, with why: several statements (`;`) anywhere, and on lines over
    LONG characters several computed assignments (`a, b = f(x), g(y)`), a comment beside code, a conditional
    expression or a call nested three deep on one line."""
    lines = source.splitlines()
    long = lambda number: len(lines[number - 1]) > LONG
    found = {}
    statements = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and not isinstance(node, BLOCKS):
            statements.setdefault(node.lineno, []).append(node)
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Tuple)
        ):
            if long(node.lineno) and not all(isinstance(value, SIMPLE_VALUES) for value in node.value.elts):
                found.setdefault(node.lineno, "several assignments")
        if isinstance(node, ast.IfExp) and long(node.lineno):
            found.setdefault(node.lineno, "long conditional expression")
        one_line_call = isinstance(node, ast.Call) and node.lineno == node.end_lineno
        if one_line_call and long(node.lineno) and call_depth(node) >= 3:
            found.setdefault(node.lineno, "long nested call")
    for number, nodes in statements.items():
        if len(nodes) > 1:
            found.setdefault(number, "several statements")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        number, column = token.start
        if token.type == tokenize.COMMENT and lines[number - 1][:column].strip() and long(number):
            found.setdefault(number, "comment beside long code")
    return dict(sorted(found.items()))


LONGEST_FUNCTION = 60  # lines, the `def` line to the last (decorators left out): the house rule


def function_lengths(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function of `source`, methods and nested functions included:
    `Checkpoints.restore`, `make_learner_update.update`."""
    found = []

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def definitions(source: str) -> dict[str, str]:
    """name -> text (decorators included) of each top-level function and class of a script."""
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            found[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    return found


def code_lines_over(source: str, length: int) -> int:
    """Lines over `length` characters that are code: docstrings (string statements) and comment lines left out."""
    prose = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    return sum(
        len(line) > length and number not in prose and not line.lstrip().startswith("#")
        for number, line in enumerate(source.splitlines(), 1)
    )


def shape(source: str) -> dict:
    tree = ast.parse(source)
    lines = {node.name: node.end_lineno - node.lineno + 1 for node in tree.body if hasattr(node, "name")}
    imported = [
        alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cleanrl_utils")
        for alias in node.names
    ]
    long = [f"{name} {n}" for name, n in function_lengths(source) if n > LONGEST_FUNCTION]
    return {
        "lines": len(source.splitlines()),
        "main": lines.get("main"),
        "Args": lines.get("Args"),
        "actor": lines.get("actor_loop") or lines.get("rollout"),
        "functions over 60 lines": ", ".join(long) or "none",
        "cleanrl_utils names": len(imported),
        "over 100": sum(len(line) > 100 for line in source.splitlines()),
        "over 110": sum(len(line) > 110 for line in source.splitlines()),
        "code over 100": code_lines_over(source, 100),
        "packed": len(packed_lines(source)),
    }


def after_first_def(source: str) -> str:
    lines = source.splitlines(keepends=True)
    first = next(number for number, line in enumerate(lines) if line.startswith("def "))
    return "".join(lines[first:])


@dataclass
class Args:
    rev: str | None = None
    """a git revision (default: the working tree)"""
    packed: bool = False
    """list each script's packed lines"""


def main(options: Args):
    rev = options.rev
    sources = {name: read(f"cleanba/{file}", rev) for name, file in SCRIPTS.items()}
    print(f"| script | {' | '.join(shape(sources['ppo']))} |\n|---|{'---|' * len(shape(sources['ppo']))}")
    for name, source in sources.items():
        print(f"| {name} | {' | '.join(str(value) for value in shape(source).values())} |")
    totals = {measure: sum(shape(source)[measure] for source in sources.values()) for measure in ["over 100", "packed"]}
    print(
        f"all scripts: {sum(len(source.splitlines()) for source in sources.values())} lines, "
        + ", ".join(f"{n} {measure}" for measure, n in totals.items())
    )
    if options.packed:
        for name, source in sources.items():
            for number, why in packed_lines(source).items():
                print(f"cleanba/{SCRIPTS[name]}:{number}: {why}")
    with tempfile.TemporaryDirectory() as folder:
        for name, source in sources.items():
            Path(folder, name).write_text(source)
            Path(folder, f"{name}.defs").write_text(after_first_def(source))
        for a, b in PAIRS:
            diff = subprocess.run(["diff", f"{folder}/{a}", f"{folder}/{b}"], capture_output=True, text=True).stdout
            changed = sum(line[:1] in "<>" for line in diff.splitlines())
            diff_defs = subprocess.run(
                ["diff", f"{folder}/{a}.defs", f"{folder}/{b}.defs"], capture_output=True, text=True
            ).stdout
            changed_defs = sum(line[:1] in "<>" for line in diff_defs.splitlines())
            print(
                f"diff {a} {b} | wc -l: {len(diff.splitlines())}; changed lines: {changed}, "
                f"after the first def: {changed_defs}"
            )
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev or "HEAD", "cleanrl_utils"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if rev is None:
        listing = [str(path.relative_to(REPO)) for path in sorted((REPO / "cleanrl_utils").rglob("*.py"))]
    modules = {path: len(read(path, rev).splitlines()) for path in listing if path.endswith(".py")}
    print(
        "cleanrl_utils: "
        + ", ".join(f"{Path(path).relative_to('cleanrl_utils')} {n}" for path, n in modules.items())
        + f" (total {sum(modules.values())})"
    )


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
