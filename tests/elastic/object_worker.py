"""A light elastic job (no Keras): ObjectState, a numpy 'model' trained by allreduce.

    kdrun ... python object_worker.py OUT_DIR STEPS

Each step: every rank adds its gradient (rank-independent here: a function of
the step) through an allreduce, commits, and appends to a log. Kill points,
from the environment, apply in the launch given by KD_KILL_LAUNCH (default 0;
"all": every launch):
  KD_KILL_RANK=R KD_KILL_STEP=S  SIGKILL rank R before step S (creating the
  file KD_TOUCH_BEFORE_KILL first, when given). KD_STEP_SLEEP=S slows steps down.
A file OUT_DIR/launch<L>.rank<R>.json records what the rank did.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import keras_dist as kd

out, steps = sys.argv[1], int(sys.argv[2])
kd.init()
launch = kd._get().config.elastic_round  # kdrun's launches, or torchrun's restarts
kill_launch = os.environ.get("KD_KILL_LAUNCH", "0")
kill_rank = int(os.environ.get("KD_KILL_RANK", "-1"))
kill_step = int(os.environ.get("KD_KILL_STEP", "-1"))
step_sleep = float(os.environ.get("KD_STEP_SLEEP", "0"))
log = {"launch": launch, "rank": kd.rank(), "size": kd.size(), "steps": [], "resets": 0}


state = kd.elastic.ObjectState(step=0, weights=np.zeros(4))


def on_reset():
    log["resets"] += 1


state.register_reset_callbacks([on_reset])


@kd.elastic.run
def train(state):
    log["start"] = state.step
    while state.step < steps:
        if (kill_launch in ("all", str(launch)) and kd.rank() == kill_rank
                and state.step == kill_step):
            if os.environ.get("KD_TOUCH_BEFORE_KILL"):
                open(os.environ["KD_TOUCH_BEFORE_KILL"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        grad = np.sin(np.arange(4) + state.step) * (kd.rank() + 1)
        state.weights = state.weights + kd.allreduce(grad, op=kd.Average)
        state.step += 1
        time.sleep(step_sleep)
        log["steps"].append(state.step)
        state.commit()
    return state.weights


weights = train(state)
log["weights"] = [float(w) for w in weights]
with open(os.path.join(out, f"launch{launch}.rank{kd.rank()}.json"), "w") as f:
    json.dump(log, f)
print(f"OBJECT WORKER OK launch={launch} rank={kd.rank()} size={kd.size()} step={state.step}")
