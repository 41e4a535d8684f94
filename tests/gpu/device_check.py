"""keras_dist on a real GPU, one section per process (run by tests/gpu/device_check.sh).

    python3 tests/gpu/device_check.py SECTION

Sections: versions, nccl1, jax_step, torch_step, memory, shared_gpu
(shared_gpu_worker is what shared_gpu launches on each rank). Every sub-check
prints one line, ``CHECK <name>: PASS|FAIL <details>``, with the values it
compared (largest error against a float64 numpy reference computed here from
the inputs, dtypes, devices, keras_dist's counters); a failing or raising
sub-check does not stop the others. Exit status 1 when any failed.

The one-rank sections turn keras_dist's size-one shortcut off
(``KERAS_DIST_SIZE_ONE_SHORTCUT=0``) and ask for NCCL
(``KERAS_DIST_GPU_OPERATIONS=nccl``), so a one-GPU machine runs the GPU data
plane and ``DistributedOptimizer``'s reduction for real.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

import numpy as np

# ---------------------------------------------------------------------------
# Reporting and reference comparisons, shared by every section.

FAILED: list[str] = []
PASSED: list[str] = []


def report(name: str, ok: bool, details: str) -> bool:
    (PASSED if ok else FAILED).append(name)
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} {details}", flush=True)
    return ok


def info(text: str) -> None:
    print(f"INFO {text}", flush=True)


def attempt(name: str, body) -> None:
    """Runs ``body()``; an exception it raises is a FAIL of ``name`` (with where)."""
    try:
        body()
    except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the rest
        frames = traceback.extract_tb(error.__traceback__)
        where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                          for f in frames[-3:])
        message = " ".join(str(error).split())[:600]
        report(name, False, f"raised {type(error).__name__}: {message} [at {where}]")


def finish(section: str) -> int:
    print(f"SECTION {section}: {len(PASSED)} passed, {len(FAILED)} failed"
          + (f" ({', '.join(FAILED)})" if FAILED else ""), flush=True)
    return 1 if FAILED or not PASSED else 0


def sample(shape, seed: int, dtype: str) -> np.ndarray:
    """Seeded random values, never zero, as float64: magnitudes in [0.25, 4]
    (integers: even numbers in [2, 2000], so halving and tripling are exact)."""
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], size=shape)
    if dtype.startswith("int"):
        return sign * 2.0 * rng.integers(1, 1001, size=shape)
    return sign * rng.uniform(0.25, 4.0, size=shape)


#: Largest error allowed, relative to the reference's largest magnitude: a few
#: roundings in the dtype (the input is already in it; the scalings round).
RELATIVE_TOLERANCE = {"int32": 0.0, "float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6,
                      "float64": 1e-12}


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def describe(value) -> dict:
    """What a result is: its kind, dtype name, device, shape and values as float64."""
    module = type(value).__module__
    if module.startswith("cupy"):
        import cupy

        return {"kind": "cupy.ndarray" if isinstance(value, cupy.ndarray) else type(value).__name__,
                "dtype": str(value.dtype), "device": f"cuda:{value.device.id}",
                "shape": tuple(value.shape),
                "values": cupy.asnumpy(value).astype(np.float64)}
    if module.startswith("torch"):
        import torch

        return {"kind": "torch.Tensor" if isinstance(value, torch.Tensor) else type(value).__name__,
                "dtype": str(value.dtype).replace("torch.", ""), "device": str(value.device),
                "shape": tuple(value.shape),
                "values": value.detach().to("cpu", torch.float64).numpy()}
    if module.startswith("jax"):
        devices = sorted(f"{d.platform}:{d.id}" for d in value.devices())
        return {"kind": "jax.Array", "dtype": str(value.dtype), "device": ",".join(devices),
                "shape": tuple(value.shape), "values": np.asarray(value).astype(np.float64)}
    array = np.asarray(value)
    return {"kind": type(value).__name__, "dtype": str(array.dtype), "device": "cpu",
            "shape": array.shape, "values": array.astype(np.float64)}


COUNTER_NAMES = ("allreduce", "gpu_allreduce", "device_to_host")


def counters() -> dict:
    """keras_dist's counters this check reads (None: not in this keras_dist)."""
    from keras_dist.ops import COUNTERS

    return {name: COUNTERS.get(name) for name in COUNTER_NAMES}


def counter_problems(before: dict, after: dict, min_gpu_allreduce: int,
                     host_copies_expected: bool = False) -> tuple[str, list[str]]:
    """The counters' changes as text, and what is wrong with them."""
    problems, parts = [], []
    for name in COUNTER_NAMES:
        if before[name] is None or after[name] is None:
            parts.append(f"{name}=missing")
            if name != "allreduce":
                problems.append(f"keras_dist.ops.COUNTERS has no {name!r}")
            continue
        parts.append(f"{name}+{after[name] - before[name]}")
    gained = lambda name: (after[name] or 0) - (before[name] or 0)  # noqa: E731
    if before["gpu_allreduce"] is not None and gained("gpu_allreduce") < min_gpu_allreduce:
        problems.append(f"gpu_allreduce rose by {gained('gpu_allreduce')}, expected at least "
                        f"{min_gpu_allreduce}")
    if (before["device_to_host"] is not None and not host_copies_expected
            and gained("device_to_host") != 0):
        problems.append(f"device_to_host rose by {gained('device_to_host')}, expected 0")
    return " ".join(parts), problems


def verify(name: str, got, template, want: np.ndarray, before: dict, after: dict, *,
           min_gpu_allreduce: int = 1, host_copies_expected: bool = False,
           note: str = "", problems: list[str] | None = None) -> bool:
    """One result against its template (kind, dtype, device, shape), its float64
    reference (``want``) and the counters' changes (``problems``: others found
    by the caller); one CHECK line."""
    have, like = describe(got), describe(template)
    problems = list(problems or []) + [
        f"{key} {have[key]} != input's {like[key]}"
        for key in ("kind", "dtype", "device", "shape") if have[key] != like[key]]
    error = float(np.max(np.abs(have["values"] - want))) if want.size else 0.0
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    tolerance = RELATIVE_TOLERANCE.get(have["dtype"], 1e-6) * scale
    if not error <= tolerance:
        problems.append(f"max_abs_err {error:.3g} > tolerance {tolerance:.3g}")
    counted, counter_issues = counter_problems(before, after, min_gpu_allreduce,
                                               host_copies_expected)
    problems += counter_issues
    details = (f"{have['kind']} {have['dtype']} on {have['device']} shape={have['shape']} "
               f"max_abs_err={error:.3g} (tol {tolerance:.3g}, ref max |x| {scale:.4g}) "
               f"{counted}{' ' + note if note else ''}")
    return report(name, not problems, details + ("" if not problems else
                                                 " | PROBLEMS: " + "; ".join(problems)))


def reference(inputs64: list[np.ndarray], op: str, size: int, prescale: float,
              postscale: float) -> np.ndarray:
    """What allreduce must return, in float64, from every rank's input."""
    total = np.sum([x * prescale for x in inputs64], axis=0)
    if op == "Average":
        total = total / size
    return total * postscale


#: (op name, prescale, postscale) of the one-rank cases.
CASES = (("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Average", 0.5, 3.0))


def set_env(**values) -> None:
    """Sets (a value) or unsets (None) environment variables, and says so."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    info("env " + " ".join(f"{k}={os.environ.get(k, '<unset>')}" for k in values))


def require_gpu(section: str):
    """cupy, when it imports and sees a GPU; else a FAIL line and exit 1."""
    try:
        import cupy
    except Exception as error:  # noqa: BLE001
        report(f"{section}.gpu", False, f"cupy does not import ({type(error).__name__}: "
               f"{error}): this section needs a CUDA GPU with cupy (cupy-cuda13x) and NCCL")
        sys.exit(finish(section))
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - cupy raises its own CUDA errors
        count, why = 0, f"{type(error).__name__}: {error}"
    else:
        why = f"{count} visible"
    if count == 0:
        report(f"{section}.gpu", False, f"cupy {cupy.__version__} sees no CUDA GPU ({why}): "
               "this section needs one")
        sys.exit(finish(section))
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    info(f"cupy {cupy.__version__}: {count} GPU(s), GPU 0 is {name}")
    return cupy


def one_rank_init(section: str):
    """keras_dist initialised at one rank, NCCL asked for, the shortcut off;
    else a FAIL line and exit 1 (nothing else of the section can run)."""
    import keras_dist as kd

    try:
        kd.init()
    except Exception as error:  # noqa: BLE001
        report(f"{section}.init", False, f"kd.init() raised {type(error).__name__}: {error}")
        sys.exit(finish(section))
    group = kd._get()
    shortcut = getattr(group.config, "size_one_shortcut", "missing")
    report(f"{section}.init", kd.size() == 1 and shortcut is False
           and group.config.gpu_operations == "nccl",
           f"size={kd.size()} rank={kd.rank()} local_rank={kd.local_rank()} "
           f"size_one_shortcut={shortcut} gpu_operations={group.config.gpu_operations} "
           f"cpu transport={group.transport.name}")
    return kd


def check_transport(section: str, expected: str) -> None:
    import keras_dist as kd

    transport = kd._get().gpu_transport
    name = getattr(transport, "name", None)
    report(f"{section}.gpu_transport", name == expected,
           f"kd._get().gpu_transport.name={name!r} (expected {expected!r}), "
           f"device={getattr(getattr(transport, 'device', None), 'id', '?')}")


# ---------------------------------------------------------------------------
# versions: what the machine has, and that the carried install is the one used.


def section_versions() -> int:
    set_env(KERAS_BACKEND="torch",  # the image has no TensorFlow
            XLA_PYTHON_CLIENT_PREALLOCATE="false")  # this section only lists JAX's devices
    info(f"python {sys.version.split()[0]} at {sys.executable}")
    site = os.environ.get("PYTHONPATH", "")

    def show(module_name: str, extra=None, from_carried: bool = False):
        def body():
            module = __import__(module_name)
            where = os.path.dirname(getattr(module, "__file__", "") or "?")
            details = f"{getattr(module, '__version__', '?')} from {where}"
            if extra is not None:
                details += " " + extra(module)
            ok = not from_carried or any(where.startswith(p) for p in site.split(":") if p)
            report(f"versions.{module_name}", ok, details + ("" if ok else
                   f" | PROBLEM: not the carried install (PYTHONPATH={site!r})"))
        attempt(f"versions.{module_name}", body)

    def torch_extra(torch):
        if not torch.cuda.is_available():
            return "cuda: NOT available"
        return (f"cuda {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
                f"{torch.cuda.get_device_name(0)}")

    def jax_extra(jax):
        return f"backend {jax.default_backend()}, devices {jax.devices()}"

    def cupy_extra(cupy):
        from cupy.cuda import nccl

        runtime = cupy.cuda.runtime.runtimeGetVersion()
        bf16 = "?"
        try:
            import ml_dtypes

            probe = cupy.asarray(np.arange(4, dtype=ml_dtypes.bfloat16))
            bf16 = f"yes ({cupy.asnumpy(probe * 2).astype(np.float32).tolist()})"
        except Exception as error:  # noqa: BLE001
            bf16 = f"no ({type(error).__name__}: {str(error)[:120]})"
        return (f"cuda runtime {runtime}, {cupy.cuda.runtime.getDeviceCount()} GPU(s), "
                f"nccl available={getattr(nccl, 'available', '?')} "
                f"nccl version {nccl.get_version()}, bfloat16 arrays: {bf16}")

    def mpi4py_extra(mpi4py):
        from mpi4py import MPI

        library = MPI.Get_library_version().splitlines()[0].strip()
        return f"MPI {MPI.Get_version()} library {library!r}"

    def keras_dist_extra(keras_dist):
        from keras_dist.launcher.mpiexec import find_mpiexec

        return (f"nccl_built={keras_dist.nccl_built()}, kdrun's mpiexec: {find_mpiexec()}, "
                f"mpiexec on PATH: {shutil.which('mpiexec')}")

    def native():
        try:
            from keras_dist import _native
        except ImportError as error:
            report("versions.native", False, f"keras_dist._native does not import: {error} "
                   "(shm transport unavailable; the CPU data plane falls back to MPI)")
            return
        report("versions.native", True, f"keras_dist._native from {_native.__file__}")

    show("numpy")
    show("keras_dist", keras_dist_extra, from_carried=True)
    show("keras", from_carried=True)
    attempt("versions.native", native)
    show("mpi4py", mpi4py_extra, from_carried=True)
    show("cupy", cupy_extra)
    show("torch", torch_extra)
    show("jax", jax_extra)
    return finish("versions")


# ---------------------------------------------------------------------------
# nccl1: cupy, torch and JAX values through NCCL at one rank.


def framework_case(kd, name, value, host, kd_op, op, pre, post, host_path, synchronize):
    """One allreduce of a framework's GPU value at one rank, checked (``host_path``:
    bfloat16 where cupy has none, which must take the host path)."""
    before = counters()
    got = kd.allreduce(value, op=kd_op, prescale_factor=pre, postscale_factor=post)
    synchronize()
    if hasattr(got, "block_until_ready"):
        got.block_until_ready()
    after = counters()
    verify(name, got, value, reference([host], op, 1, pre, post), before, after,
           min_gpu_allreduce=0 if host_path else 1, host_copies_expected=host_path,
           note="(host path expected: cupy has no bfloat16)" if host_path else "")


def section_nccl1() -> int:
    set_env(KERAS_BACKEND="torch", KERAS_DIST_SIZE_ONE_SHORTCUT="0",
            KERAS_DIST_GPU_OPERATIONS="nccl", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cupy = require_gpu("nccl1")
    kd = one_rank_init("nccl1")
    ops = {"Sum": kd.Sum, "Average": kd.Average}
    shape = (37, 29)

    # cupy arrays
    cupy_bfloat16 = True
    try:
        probe = cupy.asarray(np.ones(4, numpy_dtype("bfloat16")))
        cupy_bfloat16 = float(cupy.asnumpy(probe * 3).astype(np.float32)[0]) == 3.0
    except Exception as error:  # noqa: BLE001
        cupy_bfloat16 = False
        info(f"cupy {cupy.__version__} has no bfloat16 arrays ({type(error).__name__}: "
             f"{error}); bfloat16 is checked with torch tensors instead")
    dtypes = ["int32", "float16"] + (["bfloat16"] if cupy_bfloat16 else []) + [
        "float32", "float64"]
    for seed, dtype in enumerate(dtypes):
        host = sample(shape, 100 + seed, dtype).astype(numpy_dtype(dtype))
        x = cupy.asarray(host)
        for op, pre, post in CASES:
            name = f"nccl1.cupy.{dtype}.{op}.pre{pre:g}.post{post:g}"

            def case(x=x, host=host, op=op, pre=pre, post=post, name=name):
                before = counters()
                got = kd.allreduce(x, op=ops[op], prescale_factor=pre, postscale_factor=post)
                cupy.cuda.get_current_stream().synchronize()
                after = counters()
                unchanged = bool((cupy.asnumpy(x) == host).all())
                verify(name, got, x, reference([host.astype(np.float64)], op, 1, pre, post),
                       before, after, note=f"input_unchanged={unchanged}",
                       problems=[] if unchanged else ["the input array was modified"])
            attempt(name, case)
    check_transport("nccl1", "nccl")

    # torch CUDA tensors
    def torch_cases():
        import torch

        torch.cuda.set_device(0)
        for seed, dtype in enumerate(["float32", "float16", "bfloat16", "int32"]):
            host = sample(shape, 200 + seed, dtype)
            t = torch.tensor(host, dtype=getattr(torch, dtype), device="cuda:0")
            host = t.to("cpu", torch.float64).numpy()
            host_path = dtype == "bfloat16" and not cupy_bfloat16
            for op, pre, post in CASES:
                name = f"nccl1.torch.{dtype}.{op}.pre{pre:g}.post{post:g}"

                attempt(name, functools.partial(
                    framework_case, kd, name, t, host, ops[op], op, pre, post, host_path,
                    torch.cuda.synchronize))
        # grouped: several dtypes in one call, one fused bucket per dtype
        grouped = ["float32", "float16", "int32", "float32"] + (
            ["bfloat16"] if cupy_bfloat16 else [])
        shapes = [(300,), (17, 5), (64,), (2, 3, 4), (129,)]
        tensors = [torch.tensor(sample(s, 300 + i, d), dtype=getattr(torch, d), device="cuda:0")
                   for i, (s, d) in enumerate(zip(shapes, grouped))]
        before = counters()
        results = kd.grouped_allreduce(tensors, op=kd.Average, prescale_factor=0.5,
                                       postscale_factor=3.0)
        torch.cuda.synchronize()
        after = counters()
        buckets = len(set(grouped))
        for i, (got, t) in enumerate(zip(results, tensors)):
            want = reference([t.to("cpu", torch.float64).numpy()], "Average", 1, 0.5, 3.0)
            verify(f"nccl1.torch.grouped[{i}].{grouped[i]}", got, t, want, before, after,
                   min_gpu_allreduce=buckets,
                   note=f"({len(tensors)} tensors, {buckets} dtypes in one call)")
    attempt("nccl1.torch", torch_cases)

    # JAX GPU arrays, eagerly
    def jax_cases():
        import jax
        import jax.numpy as jnp

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not report("nccl1.jax.gpu", bool(gpus), f"jax {jax.__version__} devices "
                      f"{jax.devices()}"):
            return
        for seed, dtype in enumerate(["float32", "float16", "bfloat16", "int32"]):
            x = jax.device_put(jnp.asarray(sample(shape, 400 + seed, dtype), dtype=dtype),
                               gpus[0])
            host = np.asarray(x).astype(np.float64)
            host_path = dtype == "bfloat16" and not cupy_bfloat16
            for op, pre, post in (CASES[0], CASES[2]):
                name = f"nccl1.jax.{dtype}.{op}.pre{pre:g}.post{post:g}"

                attempt(name, functools.partial(
                    framework_case, kd, name, x, host, ops[op], op, pre, post, host_path,
                    lambda: None))
    attempt("nccl1.jax", jax_cases)
    return finish("nccl1")


# ---------------------------------------------------------------------------
# jax_step and torch_step: a reduction inside a traced step, and Keras fit.

STEPS = 3


def fit_matches_plain_sgd(section: str, kd, on_gpu) -> None:
    """DistributedOptimizer(SGD) at one rank (shortcut off) trains exactly as SGD."""
    import keras

    rng = np.random.default_rng(7)
    x = rng.standard_normal((32 * STEPS, 8)).astype(np.float32)
    y = (x @ rng.standard_normal((8, 1))).astype(np.float32)

    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(1)])

    initial = build().get_weights()

    def train(optimizer):
        model = build()
        model.set_weights(initial)
        model.compile(optimizer=optimizer, loss="mse")
        before = counters()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        after = counters()
        return model, [np.asarray(w, np.float64) for w in model.get_weights()], before, after

    _, plain, _, _ = train(keras.optimizers.SGD(0.1))
    model, distributed, before, after = train(kd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    device = on_gpu(model.weights[0].value)
    report(f"{section}.fit.device", device[0], f"model weights on {device[1]} "
           f"(backend {keras.backend.backend()}, jit_compile={model.jit_compile})")
    moved = max(float(np.max(np.abs(p - i))) for p, i in zip(plain, initial))
    diffs = [float(np.max(np.abs(d - p))) for d, p in zip(distributed, plain)]
    scale = max(float(np.max(np.abs(p))) for p in plain)
    tolerance = 1e-6 * max(scale, 1.0)
    report(f"{section}.fit.weights", moved > 1e-4 and max(diffs) <= tolerance,
           f"{len(plain)} weights after {STEPS} steps: max |distributed - plain| "
           f"{max(diffs):.3g} (per weight {[f'{d:.2g}' for d in diffs]}, tol {tolerance:.3g}); "
           f"training moved weights by up to {moved:.3g} (must be > 1e-4)")
    counted, problems = counter_problems(before, after, STEPS)
    report(f"{section}.fit.counters", not problems,
           f"during fit with DistributedOptimizer: {counted} (gpu_allreduce at least {STEPS}, "
           f"device_to_host 0)" + ("" if not problems else " | PROBLEMS: " + "; ".join(problems)))


def section_jax_step() -> int:
    set_env(KERAS_BACKEND="jax", KERAS_DIST_SIZE_ONE_SHORTCUT="0",
            KERAS_DIST_GPU_OPERATIONS="nccl", XLA_PYTHON_CLIENT_PREALLOCATE=None)
    require_gpu("jax_step")
    kd = one_rank_init("jax_step")
    info(f"after kd.init(): XLA_PYTHON_CLIENT_PREALLOCATE="
         f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '<unset>')}")
    import jax
    import jax.numpy as jnp

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not report("jax_step.gpu", bool(gpus), f"jax {jax.__version__} devices {jax.devices()}"):
        return finish("jax_step")

    @jax.jit
    def step(x):
        return kd.allreduce(x, op=kd.Sum, prescale_factor=2.0)

    for seed, dtype in enumerate(["float32", "float16", "bfloat16"]):
        x = jax.device_put(jnp.asarray(sample((1000,), 500 + seed, dtype), dtype=dtype), gpus[0])
        host = np.asarray(x).astype(np.float64)

        def jaxpr(x=x):
            names = sorted({e.primitive.name for e in jax.make_jaxpr(step.__wrapped__)(x).eqns})
            info(f"jax_step.jit.{x.dtype}: the traced step's primitives: {names}")
        attempt(f"jax_step.jit.{dtype}.jaxpr", jaxpr)
        for call in (1, 2):
            name = f"jax_step.jit.{dtype}.call{call}"

            def case(x=x, host=host, name=name):
                before = counters()
                got = step(x)
                got.block_until_ready()
                after = counters()
                verify(name, got, x, reference([host], "Sum", 1, 2.0, 1.0), before, after)
            attempt(name, case)

    def on_gpu(value):
        devices = sorted(f"{d.platform}:{d.id}" for d in value.devices())
        return all(d.startswith("gpu") for d in devices), ",".join(devices)

    attempt("jax_step.fit", lambda: fit_matches_plain_sgd("jax_step", kd, on_gpu))
    return finish("jax_step")


def section_torch_step() -> int:
    set_env(KERAS_BACKEND="torch", KERAS_DIST_SIZE_ONE_SHORTCUT="0",
            KERAS_DIST_GPU_OPERATIONS="nccl", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    require_gpu("torch_step")
    kd = one_rank_init("torch_step")
    import torch

    if not report("torch_step.gpu", torch.cuda.is_available(),
                  f"torch {torch.__version__} cuda available={torch.cuda.is_available()}"):
        return finish("torch_step")
    torch.cuda.set_device(0)
    for seed, dtype in enumerate(["float32", "float16", "bfloat16"]):
        t = torch.tensor(sample((1000,), 600 + seed, dtype), dtype=getattr(torch, dtype),
                         device="cuda:0")
        host = t.to("cpu", torch.float64).numpy()
        for call in (1, 2):
            name = f"torch_step.eager.{dtype}.call{call}"

            def case(t=t, host=host, name=name):
                before = counters()
                got = kd.allreduce(t, op=kd.Sum, prescale_factor=2.0)
                torch.cuda.synchronize()
                after = counters()
                verify(name, got, t, reference([host], "Sum", 1, 2.0, 1.0), before, after)
            attempt(name, case)

    def on_gpu(value):
        return value.device.type == "cuda", str(value.device)

    attempt("torch_step.fit", lambda: fit_matches_plain_sgd("torch_step", kd, on_gpu))
    return finish("torch_step")


# ---------------------------------------------------------------------------
# memory: after kd.init() and an NCCL allreduce, the frameworks still allocate.

GIB = 1 << 30


def section_memory() -> int:
    set_env(KERAS_BACKEND="jax", KERAS_DIST_SIZE_ONE_SHORTCUT="0",
            KERAS_DIST_GPU_OPERATIONS="nccl", XLA_PYTHON_CLIENT_PREALLOCATE=None)
    cupy = require_gpu("memory")
    import keras  # noqa: F401 - as a user's script: Keras (and so JAX) first, then init

    try:
        from jax._src import xla_bridge

        info(f"JAX's GPU client made before kd.init(): {xla_bridge.backends_are_initialized()}")
    except Exception as error:  # noqa: BLE001 - a private API, only informative
        info(f"cannot tell whether JAX's client exists before kd.init() ({error})")
    kd = one_rank_init("memory")
    info(f"after kd.init(): XLA_PYTHON_CLIENT_PREALLOCATE="
         f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '<unset>')}, "
         f"XLA_PYTHON_CLIENT_MEM_FRACTION="
         f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '<unset>')}")
    import jax
    import jax.numpy as jnp

    def allreduce_once():
        x = jnp.asarray(sample((4096,), 700, "float32"), dtype=jnp.float32)
        before = counters()
        got = kd.allreduce(x, op=kd.Sum)
        got.block_until_ready()
        verify("memory.nccl_allreduce", got, x,
               reference([np.asarray(x).astype(np.float64)], "Sum", 1, 1.0, 1.0),
               before, counters())
    attempt("memory.nccl_allreduce", allreduce_once)

    def usage(when: str) -> tuple[int, int]:
        free, total = cupy.cuda.runtime.memGetInfo()
        stats = {}
        try:
            stats = jax.devices()[0].memory_stats() or {}
        except Exception as error:  # noqa: BLE001
            stats = {"error": str(error)}
        info(f"GPU memory {when}: used {(total - free) / GIB:.2f} of {total / GIB:.2f} GiB "
             f"(cudaMemGetInfo); JAX bytes_limit={stats.get('bytes_limit')} "
             f"bytes_in_use={stats.get('bytes_in_use')} "
             f"peak_bytes_in_use={stats.get('peak_bytes_in_use')}")
        return total - free, total

    used, total = usage("after kd.init() and one allreduce")
    report("memory.no_preallocation", used < 0.5 * total,
           f"{used / GIB:.2f} of {total / GIB:.2f} GiB in use ({100 * used / total:.1f}%; "
           "JAX's default preallocation would hold 75%), XLA_PYTHON_CLIENT_PREALLOCATE="
           f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '<unset>')}")

    def jax_block():
        block = jnp.ones((2**28,), jnp.float32)
        total_sum = float(block.sum())
        report("memory.jax_1GiB", total_sum == 2**28,
               f"jnp.ones((2**28,), float32) on {block.devices()}: sum {total_sum:.0f} "
               f"(expected {2**28})")
        usage("with JAX's 1 GiB block")
    attempt("memory.jax_1GiB", jax_block)

    def torch_block():
        import torch

        block = torch.ones(2**28, dtype=torch.float32, device="cuda:0")
        total_sum = float(block.sum())
        report("memory.torch_1GiB", total_sum == 2**28,
               f"torch.ones(2**28) on {block.device}: sum {total_sum:.0f}")
        usage("with torch's 1 GiB block too")
    attempt("memory.torch_1GiB", torch_block)

    def cupy_block():
        block = cupy.ones(2**28, cupy.float32)
        total_sum = float(block.sum())
        report("memory.cupy_1GiB", total_sum == 2**28,
               f"cupy.ones(2**28) on cuda:{block.device.id}: sum {total_sum:.0f}")
    attempt("memory.cupy_1GiB", cupy_block)
    return finish("memory")


# ---------------------------------------------------------------------------
# shared_gpu: two ranks on the one GPU.

JOB_TIMEOUT_SECONDS = 20
RANKS = 2


def launcher() -> list[str]:
    """kdrun (the carried one, on PATH) or ``python -m keras_dist.run``, with the
    mpiexec on PATH named (the carried MPICH's, which mpi4py's library matches)."""
    kdrun = shutil.which("kdrun")
    command = [kdrun] if kdrun else [sys.executable, "-m", "keras_dist.run"]
    mpiexec = shutil.which("mpiexec")
    if mpiexec:
        command += ["--mpiexec", mpiexec]
    return command + ["-np", str(RANKS)]


def run_job(operations: str) -> tuple[int | None, float, str]:
    """The two-rank worker job with ``KERAS_DIST_GPU_OPERATIONS=operations``:
    (exit status, None when it had to be stopped; seconds; its output)."""
    command = launcher() + [sys.executable, os.path.abspath(__file__), "shared_gpu_worker"]
    env = dict(os.environ, KERAS_DIST_GPU_OPERATIONS=operations, KERAS_BACKEND="torch",
               KERAS_DIST_TIMEOUT_SECONDS="15", PYTHONUNBUFFERED="1")
    info(f"launching ({operations}): {' '.join(command)}")
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_SECONDS)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # kdrun forwards it to mpiexec
        try:
            output, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        status = None
    elapsed = time.monotonic() - started
    for line in output.splitlines():
        print(f"   | {line}", flush=True)
    return status, elapsed, output


def section_shared_gpu() -> int:
    require_gpu("shared_gpu")

    def staged():
        status, elapsed, output = run_job("auto")
        results = {int(m.group(1)): m.group(0)
                   for m in re.finditer(r"RESULT rank=(\d+) .*", output)}
        transports = set(re.findall(r"RESULT rank=\d+ .*?transport='([^']*)'", output))
        errors = [float(e) for e in re.findall(r"RESULT rank=\d+ .*?max_abs_err=(\S+)", output)]
        oks = re.findall(r"RESULT rank=\d+ .*?ok=(\w+)", output)
        problems = []
        if status != 0:
            problems.append(f"exit status {status} ({'stopped after' if status is None else 'in'}"
                            f" {elapsed:.1f} s)")
        if sorted(results) != list(range(RANKS)):
            problems.append(f"results from ranks {sorted(results)}, expected {list(range(RANKS))}")
        if not transports or not all(t.startswith("host-staged") for t in transports):
            problems.append(f"GPU transports {sorted(transports)}, expected host-staged ...")
        if not oks or not all(ok == "True" for ok in oks):
            problems.append(f"per-rank value checks {oks}")
        report("shared_gpu.auto_host_staged", not problems,
               f"{RANKS} ranks on one GPU, KERAS_DIST_GPU_OPERATIONS=auto: exit {status} in "
               f"{elapsed:.1f} s, transports {sorted(transports)}, max_abs_err per rank "
               f"{errors}" + ("" if not problems else " | PROBLEMS: " + "; ".join(problems)))

    def nccl_refused():
        status, elapsed, output = run_job("nccl")
        raised = {int(m.group(1)): m.group(2)
                  for m in re.finditer(r"RAISED rank=(\d+) (.*)", output)}
        saying_share = sorted(r for r, text in raised.items() if "share" in text.lower())
        problems = []
        if status is None:
            problems.append(f"did not end within {JOB_TIMEOUT_SECONDS} s (hung)")
        elif status == 0:
            problems.append("exit status 0: the job did not fail")
        if saying_share != list(range(RANKS)):
            problems.append(f"ranks whose error says 'share': {saying_share}, expected "
                            f"{list(range(RANKS))}")
        first = next(iter(raised.values()), "no error printed")
        report("shared_gpu.nccl_refused", not problems,
               f"{RANKS} ranks on one GPU, KERAS_DIST_GPU_OPERATIONS=nccl: exit {status} in "
               f"{elapsed:.1f} s, ranks raising {sorted(raised)}, saying 'share' {saying_share}; "
               f"error: {first[:300]}" + ("" if not problems else
                                          " | PROBLEMS: " + "; ".join(problems)))

    attempt("shared_gpu.auto_host_staged", staged)
    attempt("shared_gpu.nccl_refused", nccl_refused)
    return finish("shared_gpu")


def section_shared_gpu_worker() -> int:
    """One rank of shared_gpu's jobs: prints RESULT (values and transport) or RAISED."""
    import cupy

    import keras_dist as kd

    rank = os.environ.get("PMI_RANK", "?")  # hydra's, until keras_dist says
    try:
        kd.init()
        rank, size = kd.rank(), kd.size()
        cupy.cuda.Device(kd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        inputs = [sample((1000,), 800 + k, "float32").astype(np.float32) for k in range(size)]
        want = reference([x.astype(np.float64) for x in inputs], "Sum", size, 1.0, 1.0)
        x = cupy.asarray(inputs[rank])
        before = counters()
        got = kd.allreduce(x, op=kd.Sum)
        cupy.cuda.get_current_stream().synchronize()
        after = counters()
        have = describe(got)
        error = float(np.max(np.abs(have["values"] - want)))
        ok = (have["kind"] == "cupy.ndarray" and have["dtype"] == "float32"
              and have["device"] == f"cuda:{x.device.id}"
              and error <= RELATIVE_TOLERANCE["float32"] * float(np.max(np.abs(want))))
        print(f"RESULT rank={rank} size={size} transport="
              f"{getattr(kd._get().gpu_transport, 'name', None)!r} {have['kind']} "
              f"{have['dtype']} on {have['device']} max_abs_err={error:.3g} ok={ok} "
              f"counters {counter_problems(before, after, 1, True)[0]}", flush=True)
    except Exception as error:  # noqa: BLE001 - reported, then this rank fails
        message = " ".join(str(error).split())
        print(f"RAISED rank={rank} {type(error).__name__}: {message}", flush=True)
        if kd.is_initialized():
            try:
                kd.barrier()  # every rank prints its error before any exits
            except Exception:  # noqa: BLE001 - the group may be unusable by now
                pass
        return 3
    return 0


SECTIONS = {
    "versions": section_versions,
    "nccl1": section_nccl1,
    "jax_step": section_jax_step,
    "torch_step": section_torch_step,
    "memory": section_memory,
    "shared_gpu": section_shared_gpu,
    "shared_gpu_worker": section_shared_gpu_worker,
}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SECTIONS:
        print(f"usage: {sys.argv[0]} {{{','.join(SECTIONS)}}}", file=sys.stderr)
        sys.exit(2)
    sys.exit(SECTIONS[sys.argv[1]]())
