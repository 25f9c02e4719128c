"""Run a cleanba script with a fault injected, as a user's run would meet it.

usage: python tests/fault_injection.py SCRIPT {env|learner|slow-checkpoint|disk-full|kill-in-rewrite} N [flags...]
  env N:             every actor's environment raises after N steps
  learner N:         the learner raises at its N-th update
                     (both print "fault injected at T", T the time.time() of the first fault, so that tests time the
                     shutdown alone, not the start before it)
  slow-checkpoint N: every checkpoint write prints "checkpoint write started: update=U" and takes N seconds longer
  disk-full N:       after the N-th checkpoint (N=0: as the first begins), no file can grow (RLIMIT_FSIZE 0: every
                     write fails in the kernel with EFBIG, as ENOSPC would on a full disk), printing "disk full now"
  kill-in-rewrite N: SIGKILL inside the TensorBoard rewrite at start, when the first old event file is about to go
                     (the rewritten file is in place; N is unused)
"""

import os
import resource
import signal
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from conftest import load_script  # noqa: E402


class InjectedFault(RuntimeError):
    pass


def main():
    script_path, fault, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.argv = [script_path, *sys.argv[4:]]
    from pathlib import Path

    script = load_script(Path(script_path))
    from cleanrl_utils import run as run_module  # the run object makes the checkpoints

    if fault == "env":
        make_env = script.make_env

        def failing_make_env(*args, **kwargs):
            envs = make_env(*args, **kwargs)
            step, steps_taken = envs.step, [0]

            def failing_step(action):
                steps_taken[0] += 1
                if steps_taken[0] > n:
                    print(f"fault injected at {time.time()}", flush=True)
                    raise InjectedFault(f"injected env failure after {n} steps")
                return step(action)

            envs.step = failing_step
            return envs

        script.make_env = failing_make_env
    elif fault == "learner":
        assemble, updates = script.assemble_global_rollout, [0]

        def failing_assemble(*args, **kwargs):
            updates[0] += 1
            if updates[0] >= n:
                print(f"fault injected at {time.time()}", flush=True)
                raise InjectedFault(f"injected learner failure at update {n}")
            return assemble(*args, **kwargs)

        script.assemble_global_rollout = failing_assemble
    elif fault == "slow-checkpoint":

        class SlowCheckpoints(run_module.Checkpoints):
            def save(self, update, *args, **kwargs):
                print(f"checkpoint write started: update={update}", flush=True)
                time.sleep(n)  # a signal that arrives now arrives while the checkpoint is being written
                return super().save(update, *args, **kwargs)

        run_module.Checkpoints = SlowCheckpoints
    elif fault == "disk-full":

        def fill_the_disk():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            print("disk full now", flush=True)

        class FillingCheckpoints(run_module.Checkpoints):
            saved = 0

            def save(self, *args, **kwargs):
                if FillingCheckpoints.saved == n == 0:
                    fill_the_disk()
                super().save(*args, **kwargs)
                FillingCheckpoints.saved += 1
                if FillingCheckpoints.saved == n:
                    fill_the_disk()

        run_module.Checkpoints = FillingCheckpoints
    elif fault == "kill-in-rewrite":
        remove = os.remove

        def killing_remove(path, *args, **kwargs):
            if "tfevents" in os.path.basename(path):
                print(f"killed while removing {os.path.basename(path)}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return remove(path, *args, **kwargs)

        os.remove = killing_remove
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    from cleanrl_utils.cli import run_cli

    sys.exit(run_cli(script.main, script.Args))


if __name__ == "__main__":
    main()
