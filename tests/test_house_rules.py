"""The house rules of the code (docs/contributing.md) as tests, read off the files (no script runs): no function over
60 lines; each script at most 850 lines, without packed lines; the copies of a definition in several scripts equal,
or listed with why they differ; every script keeps the names the tools load it by (cleanrl_utils/script_contract.py).
The last test breaks each rule on a copy of a script and checks that its check fails."""

import ast
import sys
from collections import defaultdict
from functools import cache
from types import SimpleNamespace

import pytest
from conftest import REPO

from cleanrl_utils.script_contract import CONTRACT, missing_names

sys.path.insert(0, str(REPO / "benchmark"))  # as a tool run from there has it
from script_shape import LONGEST_FUNCTION, SCRIPTS, definitions, function_lengths, packed_lines  # noqa: E402

LONGEST_SCRIPT = 850  # lines
FOLDERS = ["cleanba", "cleanrl_utils", "benchmark"]  # benchmark/results/ left out: records, not code

# name: (why its copies differ, the groups of scripts whose copies are equal); a script in no group has its own copy.
# Every other top-level function and class defined in several scripts is the same text in all of them.
TORSO_DTYPE = "the PPO and IMPALA torsos compute in --compute-dtype, R2D2's and MuZero's in float32"
DIFFERENT_COPIES = {
    "Args": ("each algorithm's flags", ()),
    "validate_args": ("each algorithm's flags and their checks", (("ppo_anakin", "ppo_anakin_continuous"),)),
    "make_env": (
        "SAC's and MuZero's docstrings say what they do with envpool's envs; Anakin's are JAX envs, for the evaluator",
        (("ppo", "impala", "pqn", "r2d2", "mujoco_ppo", "onpolicy"), ("ppo_anakin", "ppo_anakin_continuous")),
    ),
    "ResidualBlock": (TORSO_DTYPE, (("ppo", "impala"), ("r2d2", "muzero"))),
    "ConvSequence": (TORSO_DTYPE, (("ppo", "impala"),)),
    "NatureCNN": ("PQN's has LayerNorm after each layer (Gallici et al. 2024)", (("ppo", "impala"),)),
    "ImpalaCNN": (TORSO_DTYPE, (("ppo", "impala"),)),
    "MLP": (
        "tanh and orthogonal init on-policy, ReLU in the replay scripts (SAC's has float inputs)",
        (("ppo", "impala", "mujoco_ppo", "onpolicy", "ppo_anakin", "ppo_anakin_continuous"), ("r2d2", "muzero")),
    ),
    "Agent": ("each algorithm's networks", (("ppo", "impala"), ("mujoco_ppo", "ppo_anakin_continuous"))),
    "make_network": ("each script's networks for its action space", (("ppo", "impala"),)),
    "make_agent": ("each algorithm's networks and optimizers", ()),
    "Rollout": ("what each algorithm's learner needs of a rollout", (("mujoco_ppo", "onpolicy"),)),
    "ActorFns": (
        "R2D2's act carries each env's recurrent state and epsilon",
        (("ppo", "impala", "mujoco_ppo", "sac", "muzero", "onpolicy"),),
    ),
    "make_actor_fns": (
        "each algorithm's action choice (sampled, epsilon-greedy, searched), the MuJoCo scripts' normalization",
        (("mujoco_ppo", "onpolicy"),),
    ),
    "actor_params": ("what each algorithm's actors act with", (("ppo", "impala", "pqn", "muzero"),)),
    "actor_loop": ("what each algorithm's actor computes and stores", (("mujoco_ppo", "onpolicy"),)),
    "LearnerState": (
        "the running statistics, the replay scripts' replay, the Anakin scripts' envs",
        (("ppo", "impala", "pqn"), ("mujoco_ppo", "onpolicy")),
    ),
    "make_learner_update": ("each algorithm's update", ()),
    "saved_model": (
        "what each make_eval_policy reads (the Anakin scripts': one model a seed)",
        (("ppo", "impala", "pqn"),),
    ),
    "make_eval_policy": (
        "each algorithm's action choice in evaluation",
        (("ppo", "impala", "ppo_anakin"), ("mujoco_ppo", "onpolicy")),
    ),
    "check_runtime_values": (
        "IMPALA has no epochs; the Anakin scripts check --env-id once JAX has started",
        (("ppo", "mujoco_ppo", "onpolicy"),),
    ),
    "state_summary": (
        "each learner state's parts (statistics, replay, the Anakin scripts' seeds)",
        (("ppo", "impala", "pqn"), ("mujoco_ppo", "onpolicy"), ("ppo_anakin", "ppo_anakin_continuous")),
    ),
    "main": (
        "the replay scripts' replay, the on-policy script's loss defaults, the Anakin scripts' rollouts in the update",
        (("ppo", "impala", "pqn", "mujoco_ppo"), ("ppo_anakin", "ppo_anakin_continuous")),
    ),
    "LearnerFns": ("each replay learner's gradient step (R2D2's gives priorities)", ()),
    "make_replay_buffer": ("each algorithm's replay: transitions, prioritized sequences, sequences", ()),
    "replay_item": ("each algorithm's replay row", ()),
    "make_learner_fns": ("each algorithm's replay update", ()),
    "end_stored_episodes": ("MuZero's n-step targets also need the row before the newest truncated", ()),
    "set_runtime_values": ("each replay's sizes", ()),
    "Batch": (
        "the MuJoCo scripts' observations are normalized; V-MPO needs the policy at the update's start",
        (("ppo", "ppo_anakin"), ("mujoco_ppo", "ppo_anakin_continuous")),
    ),
    "AgentState": ("what each learner trains", (("mujoco_ppo", "onpolicy", "ppo_anakin_continuous"),)),
    "prepare_batch": (
        "the continuous scripts' running statistics and reward scaling; the on-policy one's V-trace",
        (("ppo", "ppo_anakin"), ("mujoco_ppo", "ppo_anakin_continuous")),
    ),
    "ppo_loss": ("categorical or Gaussian policy", (("ppo", "ppo_anakin"), ("mujoco_ppo", "ppo_anakin_continuous"))),
    "EnvState": ("the continuous script keeps each env's discounted return (reward scaling)", ()),
    "reset_envs": ("the continuous script keeps each env's discounted return (reward scaling)", ()),
    "rollout": ("the continuous script normalizes observations and scales rewards", ()),
    "Minibatch": ("SAC's transitions and noise, R2D2's sequences and their probabilities", ()),
}

# the parts of the script contract each script keeps
ON_POLICY = ("evaluation", "run", "sebulba", "on-policy learner")
REPLAY = ("evaluation", "run", "sebulba", "replay learner")
ANAKIN = ("evaluation", "run", "on-policy learner", "anakin")
CONTRACT_PARTS = {
    "ppo": ON_POLICY,
    "impala": ON_POLICY,
    "mujoco_ppo": ON_POLICY,
    "onpolicy": ON_POLICY,
    "sac": REPLAY,
    "r2d2": REPLAY,
    "muzero": REPLAY,
    "pqn": ON_POLICY,
    "ppo_anakin": ANAKIN,
    "ppo_anakin_continuous": ANAKIN,
}


@cache
def script_sources() -> dict[str, str]:
    return {name: (REPO / "cleanba" / file).read_text() for name, file in SCRIPTS.items()}


def long_functions(source: str) -> list[str]:
    return [f"{name} ({n} lines)" for name, n in function_lengths(source) if n > LONGEST_FUNCTION]


def script_shape_problems(source: str) -> list[str]:
    lines = len(source.splitlines())
    too_long = [f"{lines} lines (at most {LONGEST_SCRIPT})"] if lines > LONGEST_SCRIPT else []
    return too_long + [f"line {number} is packed: {why}" for number, why in packed_lines(source).items()]


def unequal_copies(sources: dict[str, str]) -> list[str]:
    """Each top-level definition of several scripts whose equal copies are not the groups DIFFERENT_COPIES lists (or
    all of them), and each listed name no longer defined in several scripts."""
    copies = defaultdict(dict)
    for script, source in sources.items():
        for name, text in definitions(source).items():
            copies[name][script] = text
    problems = []
    for name, texts in copies.items():
        if len(texts) < 2:
            continue
        equal = defaultdict(set)
        for script, text in texts.items():
            equal[text].add(script)
        found = {frozenset(group) for group in equal.values() if len(group) > 1}
        listed = DIFFERENT_COPIES.get(name)
        expected = {frozenset(group) for group in listed[1]} if listed else {frozenset(texts)}
        if found != expected:
            found, expected = sorted(map(sorted, found)), sorted(map(sorted, expected))
            problems.append(f"{name}: the scripts with equal copies are {found}, expected {expected}")
    gone = [name for name in DIFFERENT_COPIES if len(copies.get(name, {})) < 2]
    return problems + [f"{name}: listed in DIFFERENT_COPIES but not defined in several scripts" for name in gone]


def top_level_names(source: str) -> SimpleNamespace:
    """The names a script defines or imports at its top level, as attributes (what a tool loading it finds)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return SimpleNamespace(**dict.fromkeys(names))


def contract_problems(script: str, source: str) -> list[str]:
    missing = missing_names(top_level_names(source), CONTRACT_PARTS[script])
    return [f"no {name} ({part}: {CONTRACT[part][name].call})" for part, name in missing]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_over_60_lines(folder):
    paths = [path for path in sorted((REPO / folder).rglob("*.py")) if "results" not in path.relative_to(REPO).parts]
    found = [f"{path.relative_to(REPO)}: {long}" for path in paths for long in long_functions(path.read_text())]
    assert not found, "functions over 60 lines (split them into module-level functions):\n" + "\n".join(found)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_at_most_850_lines_without_packed_lines(script):
    """A script reads top to bottom within about 800 lines, one statement a line: `packed_lines` in
    benchmark/script_shape.py says what is packed (`python benchmark/script_shape.py --packed` lists them)."""
    problems = script_shape_problems(script_sources()[script])
    assert not problems, f"cleanba/{SCRIPTS[script]}:\n" + "\n".join(problems)


def test_every_script_is_in_the_shape_report_and_the_contract():
    assert {path.name for path in (REPO / "cleanba").glob("*.py")} == set(SCRIPTS.values())
    assert set(CONTRACT_PARTS) == set(SCRIPTS)
    assert {part for parts in CONTRACT_PARTS.values() for part in parts} == set(CONTRACT)


def test_copies_between_scripts_are_equal_or_listed_with_why_they_differ():
    """Duplication between scripts is by design (each reads alone); a change to one copy is made to all, or the copy
    is listed in DIFFERENT_COPIES with its reason."""
    assert all(why and "\n" not in why for why, _ in DIFFERENT_COPIES.values())
    problems = unequal_copies(script_sources())
    assert not problems, "copies that differ (make them equal, or list them with why):\n" + "\n".join(problems)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_keeps_the_contract_of_its_kind(script):
    """What the evaluator and the tools call in a script (cleanrl_utils/script_contract.py), for its kind."""
    problems = contract_problems(script, script_sources()[script])
    assert not problems, f"cleanba/{SCRIPTS[script]}: " + ", ".join(problems)


def replace_once(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


# each rule broken in one place of one script: (the script, its text replaced, the replacement, the rule's check)
BREAKAGES = {
    "a function over 60 lines": (
        "ppo",
        "    return update\n",
        "    # one line more\n    return update\n",
        lambda script, sources: long_functions(sources[script]),
    ),
    "a script over 850 lines": (
        "ppo",
        'if __name__ == "__main__":\n',
        "# one line more\n" * 200 + 'if __name__ == "__main__":\n',
        lambda script, sources: script_shape_problems(sources[script]),
    ),
    "a packed line": (
        "ppo",
        "    args = run.args\n",
        "    args = run.args; updates = args.num_updates\n",
        lambda script, sources: script_shape_problems(sources[script]),
    ),
    "one copy of GAE changed": (
        "mujoco_ppo",
        "    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)\n",
        "    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0) * 1.0\n",
        lambda script, sources: unequal_copies(sources),
    ),
    "one copy of a listed group changed": (
        "impala",
        '    return f"params sha256={tree_digest(state.agent.params)}"\n',
        '    return f"params sha256={tree_digest(state.agent.params)} "\n',
        lambda script, sources: unequal_copies(sources),
    ),
    "a script without make_eval_policy": (
        "sac",
        "def make_eval_policy(",
        "def make_evaluation_policy(",
        lambda script, sources: contract_problems(script, sources[script]),
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_each_rule_fails_the_change_that_breaks_it(breakage):
    script, old, new, check = BREAKAGES[breakage]
    sources = dict(script_sources())
    assert not check(script, sources)
    sources[script] = replace_once(sources[script], old, new)
    assert check(script, sources), f"{breakage} in cleanba/{SCRIPTS[script]} went unnoticed"
