"""The script contract: the names of a cleanba/ script that the tools loading it by path call (the evaluator,
cleanrl_utils/evals/evaluate.py; benchmark/throughput.py, env_ceiling.py and muzero_search_throughput.py; the tests),
how they call each and what it returns. A copy of a script kept elsewhere (`--script`) works with the tools while it
keeps the names of its kind; tests/test_house_rules.py checks that every script in cleanba/ does.

Each part is what one kind of tool needs, and is kept by the scripts it names.
"""

from typing import NamedTuple


class Name(NamedTuple):
    call: str  # how the tools call it
    returns: str  # what it returns (or is)


CONTRACT: dict[str, dict[str, Name]] = {
    # every script: the evaluator (cleanrl_utils/evals/evaluate.py), benchmark/env_ceiling.py
    "evaluation": {
        "Args": Name("Args(**flags)", "the script's flags (a dataclass); a saved model's `args` are its fields"),
        "make_env": Name(
            "make_env(env_id, seed, num_envs, render_mode=None[, num_threads][, env_options])",
            "vector envs with gymnasium's reset() and step(actions), env i seeded with seed + i; render() is env 0's",
        ),
        "make_eval_policy": Name(
            "make_eval_policy(args, model, greedy)",
            "policy(obs, key) -> (actions, key); a RecurrentPolicy (evaluate.py) where the agent has memory",
        ),
    },
    # every script: the tests, benchmark/throughput.py and muzero_search_throughput.py start and check runs with it
    "run": {
        "main": Name("main(args)", "the run's exit code"),
        "validate_args": Name("validate_args(args)", "None; a UsageError (one line) for bad flags, before JAX starts"),
        "make_agent": Name("make_agent(args, key)", "(agent, agent_state): the networks and their fresh states"),
        "LearnerState": Name("LearnerState(agent_state, key, ...)", "the learner's state, what a checkpoint holds"),
    },
    # the Sebulba scripts: benchmark/throughput.py's actor stages, muzero_search_throughput.py
    "sebulba": {
        "make_actor_fns": Name("make_actor_fns(agent[, args])", "ActorFns: the actor's jitted act(params, obs, key)"),
        "actor_params": Name("actor_params(agent_state)", "what the actors act with (the params of one version)"),
        "actor_loop": Name(
            "actor_loop(*, args, thread, key, make_envs, actor_fns, params_queue, rollout_queue)",
            "None: one actor thread, its rollouts put on rollout_queue",
        ),
    },
    # the on-policy scripts, Sebulba and Anakin: benchmark/throughput.py's learner stage, the tests
    "on-policy learner": {
        "make_learner_update": Name(
            "make_learner_update(args, agent, mesh); Anakin: make_learner_update(args, agent, env, mesh)",
            "update(state, storage) -> (state, metrics); Anakin: update(state), the rollout inside",
        ),
        "check_runtime_values": Name(
            "check_runtime_values(args, layout)", "None; a UsageError for what the run derives from flags and layout"
        ),
    },
    # the replay scripts (SAC, R2D2, MuZero): the tests
    "replay learner": {
        "make_learner_fns": Name(
            "make_learner_fns(args, agent, mesh)",
            "LearnerFns: init_replay(), update(state, rollout, train), gradient_step",
        ),
        "set_runtime_values": Name(
            "set_runtime_values(args, layout)", "None: sets what the run derives beyond the batch (not flags) on args"
        ),
    },
    # the Anakin scripts: the tests step their envs
    "anakin": {
        "make_jax_env": Name("make_jax_env(env_id)", "the JAX env of the id (cleanrl_utils/jax_envs.py)"),
        "reset_envs": Name("reset_envs(env, key, num_envs, sharding)", "EnvState: the envs' first states"),
        "rollout": Name("rollout(*, agent, env, envs, num_steps, ...)", "(envs, Rollout): num_steps of every env"),
    },
}
# called where a script has it: args with the defaults that depend on another flag (the on-policy script's losses)
OPTIONAL = {"with_loss_defaults": Name("with_loss_defaults(args)", "args, each loss's defaults filled in")}


def missing_names(module, parts: tuple[str, ...]) -> list[tuple[str, str]]:
    """(part, name) of each name of `parts` that the loaded script `module` lacks."""
    return [(part, name) for part in parts for name in CONTRACT[part] if not hasattr(module, name)]
