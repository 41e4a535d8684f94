"""The code of a rank's own process under ``keras_dist.spark.run``:
``python -m keras_dist.clusters.spark.child WORKDIR FD``, started by its
barrier task (a fresh process: Spark reuses its Python workers from task to
task, and MPI starts only once in a process).

It loads ``fn`` from ``WORKDIR``, calls it and writes what it returned, or
raised, back there. It ends itself once its task is gone: it holds the read
end of a pipe (``FD``) whose write end only its task holds.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import threading
import traceback
from collections.abc import Sequence

#: Files a rank's process reads and writes in its task's private directory.
PAYLOAD, RESULT, FAILURE = "payload.pkl", "result.pkl", "failure.pkl"


def _end_with_task(watch_fd: int, workdir: str) -> None:
    """Ends this process once its task is gone (the pipe's write end closed),
    removing the task's directory, which the task no longer can."""
    try:
        while os.read(watch_fd, 1):
            pass
    except OSError:
        return  # fn closed the descriptor: nothing left to watch
    shutil.rmtree(workdir, ignore_errors=True)
    os._exit(1)


def _write_atomically(path: str, data: bytes) -> None:
    with open(path + ".part", "wb") as file:
        file.write(data)
    os.replace(path + ".part", path)


def main(argv: Sequence[str]) -> None:
    """Loads ``fn`` from ``WORKDIR``, calls it, writes its result or its failure there.

    An exception ``fn`` raises is recorded, then raised on: after ``kd.init()``
    keras_dist's excepthook ends the whole job with it, as under kdrun.
    """
    workdir, watch_fd = argv[0], int(argv[1])
    threading.Thread(target=_end_with_task, args=(watch_fd, workdir),
                     name="keras_dist-spark-task-watch", daemon=True).start()
    from pyspark import cloudpickle

    with open(os.path.join(workdir, PAYLOAD), "rb") as file:
        fn, args, kwargs = pickle.load(file)
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:
        _record_failure(workdir, error, "fn raised", in_fn=True)
        raise
    try:
        data = cloudpickle.dumps(result)
    except Exception as error:
        _record_failure(workdir, error, "fn returned a value that cannot be pickled:",
                        in_fn=False)
        raise
    _write_atomically(os.path.join(workdir, RESULT), data)


def _record_failure(workdir: str, error: BaseException, what: str, *, in_fn: bool) -> None:
    from pyspark import cloudpickle

    try:
        exception = cloudpickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that cannot travel: its text does
        exception = None
    summary = "".join(traceback.format_exception_only(type(error), error)).strip()
    # fn's exception from fn's own frame on; a pickling error whole.
    frames = error.__traceback__.tb_next if in_fn else error.__traceback__
    _write_atomically(os.path.join(workdir, FAILURE), pickle.dumps({
        "summary": f"{what} {summary}", "in_fn": in_fn, "exception": exception,
        "traceback": "".join(traceback.format_exception(type(error), error, frames))}))


if __name__ == "__main__":
    main(sys.argv[1:])
