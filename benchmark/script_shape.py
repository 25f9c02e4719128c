"""The shape of the scripts, as a reader meets it: lines of each script, of its `main`, its `Args` and its actor
function (a Sebulba script's `actor_loop`, the Anakin script's `rollout`; `rollout` in revisions before the rename),
its functions over 60 lines, the names it imports from cleanrl_utils, the `diff | wc -l` of the script pairs that
should differ only by their algorithm, and the lines of each cleanrl_utils module.

usage (repository root): uv run python benchmark/script_shape.py [--rev REV]   (default: the working tree)
"""

import argparse
import ast
import subprocess
import tempfile
from pathlib import Path

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
]


def read(path: str, rev: str | None) -> str:
    if rev is None:
        return (REPO / path).read_text()
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=True).stdout


def shape(source: str) -> dict:
    tree = ast.parse(source)
    lines = {node.name: node.end_lineno - node.lineno + 1 for node in tree.body if hasattr(node, "name")}
    imported = [
        alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cleanrl_utils")
        for alias in node.names
    ]
    functions = {node.name: lines[node.name] for node in tree.body if isinstance(node, ast.FunctionDef)}
    return {
        "lines": len(source.splitlines()),
        "main": lines.get("main"),
        "Args": lines.get("Args"),
        "actor": lines.get("actor_loop") or lines.get("rollout"),
        "functions over 60 lines": ", ".join(f"{name} {n}" for name, n in functions.items() if n > 60) or "none",
        "cleanrl_utils names": len(imported),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default=None, help="a git revision (default: the working tree)")
    rev = parser.parse_args().rev
    sources = {name: read(f"cleanba/{file}", rev) for name, file in SCRIPTS.items()}
    print(f"| script | {' | '.join(shape(sources['ppo']))} |\n|---|{'---|' * len(shape(sources['ppo']))}")
    for name, source in sources.items():
        print(f"| {name} | {' | '.join(str(value) for value in shape(source).values())} |")
    with tempfile.TemporaryDirectory() as folder:
        for name, source in sources.items():
            Path(folder, name).write_text(source)
        for a, b in PAIRS:
            diff = subprocess.run(["diff", f"{folder}/{a}", f"{folder}/{b}"], capture_output=True, text=True).stdout
            print(f"diff {a} {b} | wc -l: {len(diff.splitlines())}")
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
    main()
