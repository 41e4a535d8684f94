"""The shared vocabulary's dtype codes, bfloat16's loaded on first use."""

import subprocess
import sys

import numpy as np
import pytest

from keras_dist import _vocab


def test_importing_keras_dist_leaves_ml_dtypes_unimported():
    # ml_dtypes' import takes most of a second; kdrun and every rank import
    # keras_dist, so the package must not import it until a bfloat16 shows up.
    code = ("import sys, keras_dist, keras_dist.launcher.cli; "
            "print(sorted(m for m in ('ml_dtypes', 'tensorflow', 'jax', 'torch') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def test_bfloat16_has_its_code_and_name_once_ml_dtypes_is_there():
    import ml_dtypes  # a dependency of Keras: always there

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
    assert _vocab.dtype_code(bfloat16) == _vocab.BFLOAT16
    assert _vocab.is_supported(bfloat16) and _vocab.is_float(bfloat16) and _vocab.is_half(bfloat16)
    assert _vocab.bfloat16_dtype() == bfloat16
    assert _vocab.DTYPE_NAMES[_vocab.BFLOAT16] == "bfloat16"
    assert "bfloat16" in _vocab.SUPPORTED_DTYPE_NAMES


def test_every_code_names_its_dtype_and_unsupported_dtypes_raise():
    for code, name in _vocab.DTYPE_NAMES.items():
        dtype = _vocab.bfloat16_dtype() if name == "bfloat16" else np.dtype(name)
        assert _vocab.dtype_code(dtype) == code
    for dtype in (np.complex64, np.bool_, np.uint32, "U3"):
        assert not _vocab.is_supported(dtype)
        with pytest.raises(TypeError, match=r"reduces only .*bfloat16.*Received: dtype="):
            _vocab.dtype_code(dtype)
