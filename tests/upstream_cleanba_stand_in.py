"""A stand-in for upstream Cleanba's cleanba_ppo.py in tests (the suite has no network to fetch it): it takes the
flags benchmark/upstream_cleanba.py gives upstream and prints what it reads back, a `global_step=` line per update
(one more than --total-timesteps asks for, as upstream's actor does), 20 ms apart. With UPSTREAM_STAND_IN_HANGS set it
then waits forever, as upstream's actor threads do when its learner failed; with UPSTREAM_STAND_IN_KILLED it then
ends by SIGKILL, as the kernel's out-of-memory killer ends a process. A test puts the text each of the runner's edits
replaces into ANCHORS, so that the edits apply."""

import argparse
import os
import signal
import time

ANCHORS = """"""

parser = argparse.ArgumentParser()
for name in ["--env-id", "--exp-name"]:
    parser.add_argument(name, required=True)
for name in ["--seed", "--local-num-envs", "--num-actor-threads", "--num-steps", "--num-minibatches"]:
    parser.add_argument(name, type=int, required=True)
for name in ["--update-epochs", "--total-timesteps", "--log-frequency"]:
    parser.add_argument(name, type=int, required=True)
for name in ["--channels", "--hiddens", "--actor-device-ids", "--learner-device-ids"]:
    parser.add_argument(name, type=int, nargs="+", required=True)
parser.add_argument("--concurrency", action=argparse.BooleanOptionalAction, required=True)
args = parser.parse_args()
batch_size = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids) * args.num_steps
for update in range(1, args.total_timesteps // batch_size + 2):
    time.sleep(0.02)
    print(f"global_step={update * batch_size}, avg_episodic_return=0.0")
if os.environ.get("UPSTREAM_STAND_IN_KILLED"):
    os.kill(os.getpid(), signal.SIGKILL)
while os.environ.get("UPSTREAM_STAND_IN_HANGS"):
    time.sleep(1)
