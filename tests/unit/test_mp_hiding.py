"""tests/_tf_only: what a TensorFlow job's processes cannot import, and nothing else."""

import os
import subprocess
import sys

from tests import _mp


def _imports(code: str, hide: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(_mp._HIDING_DIR), "KERAS_DIST_TEST_HIDE": hide}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_hidden_packages_cannot_be_imported_and_the_rest_can():
    code = ("import numpy\ntry:\n import matplotlib.pyplot\n"
            "except ModuleNotFoundError as e:\n print('hidden', e.name)")
    done = _imports(code, "jax, matplotlib")
    assert done.returncode == 0 and done.stdout.split() == ["hidden", "matplotlib"], done
    assert _imports("import numpy, mpi4py", "jax,matplotlib").returncode == 0
    # As for a package that is not installed (torch._dynamo asks so for TensorFlow).
    done = _imports("import importlib.util as u; print(u.find_spec('matplotlib'), "
                    "u.find_spec('numpy') is None)", "jax,matplotlib")
    assert done.returncode == 0 and done.stdout.split() == ["None", "False"], done


def test_nothing_is_hidden_without_names():
    done = _imports("import sys, sitecustomize; print(len(sys.meta_path))", "")
    plain = subprocess.run([sys.executable, "-c", "import sys; print(len(sys.meta_path))"],
                           capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == plain.stdout, (done, plain)


def test_tensorflow_jobs_hide_jax_and_matplotlib_by_default_and_others_do_not():
    def hidden(env, hide=None):
        return _mp.job_environment(env, hide).get("KERAS_DIST_TEST_HIDE")

    assert hidden({"KERAS_BACKEND": None}) == "jax,jaxlib,matplotlib"
    assert hidden({"KERAS_BACKEND": "tensorflow"}) == "jax,jaxlib,matplotlib"
    assert hidden({"KERAS_BACKEND": "jax"}) is None
    assert hidden({"KERAS_BACKEND": None}, hide=()) is None
    path = _mp.job_environment({"KERAS_BACKEND": None}, None)["PYTHONPATH"].split(os.pathsep)
    assert path[:2] == [str(_mp._HIDING_DIR), str(_mp.REPO_ROOT)], path
