"""Tables Python shares with the native module agree with the native module's own.

The native module reports its dtype and op codes and the allgather record's
layout; Python's copies (``keras_dist._vocab``, ``keras_dist.tensor.gather_records``)
must match, or the engine would reduce the wrong type or read a record wrongly.
The wait timings are checked in test_liveness.py."""

import numpy as np

from keras_dist import _native, _vocab
from keras_dist.tensor import gather_records


def test_dtype_codes_are_the_native_modules():
    python = {_vocab.DTYPE_NAMES[code]: code for code in _vocab.DTYPE_NAMES}
    assert python == dict(_native.DTYPE_CODES)
    for name, code in _native.DTYPE_CODES.items():
        if name != "bfloat16":  # numpy has no bfloat16 of its own
            assert _vocab.dtype_code(np.dtype(name)) == code


def test_op_codes_are_the_native_modules():
    assert {name: code for code, name in _vocab.OP_NAMES.items()} == dict(_native.OP_CODES)
    assert (_vocab.SUM, _vocab.MIN, _vocab.MAX, _vocab.PRODUCT) == tuple(
        _native.OP_CODES[name] for name in ("sum", "min", "max", "product"))


def test_the_gather_record_layout_is_the_native_modules():
    assert dict(_native.GATHER_RECORD) == {
        "max_dims": gather_records.MAX_NDIM,
        "header_words": gather_records.HEADER_WORDS,
        "record_words": gather_records.RECORD_WORDS,
        "inline_bytes": gather_records.INLINE_BYTES,
        "record_bytes": gather_records.RECORD_BYTES,
    }


def test_a_record_reads_back_as_written():
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    record = gather_records.record_of(array)
    assert record.nbytes == gather_records.RECORD_BYTES and gather_records.is_inline(record)
    headers = gather_records.headers_of(record.reshape(1, -1))
    assert gather_records.shapes_of(headers) == [(3, 4)]
    assert headers[0][1] == array.dtype.num
    np.testing.assert_array_equal(
        gather_records.data_of(record)[: array.nbytes].view(np.int16).reshape(3, 4), array)


def test_the_native_module_writes_the_records_python_writes():
    inline = gather_records.INLINE_BYTES
    words = 8 * gather_records.RECORD_WORDS
    arrays = [np.zeros((3, 4), np.int16), np.zeros(inline // 8, np.float64),
              np.zeros(inline // 8 + 1, np.float64), np.zeros((1000, 7), np.float32),
              np.zeros((2, 1, 3, 1, 2, 1, 1, 5), np.uint8)]  # inline or not, 1 to 8 dims
    for array in arrays:
        native = _native._gather_record_words(list(array.shape), array.dtype.num,
                                              array.dtype.itemsize)
        python = gather_records.record_of(array)[:words].tobytes()
        assert native == python, (array.shape, array.dtype)


def test_an_allgather_header_is_the_records():
    array = np.zeros((5, 2, 7), np.float32)
    record = gather_records.record_of(array)
    header = gather_records.headers_of(record.reshape(1, -1))[0]
    np.testing.assert_array_equal(header, gather_records.header_of(array))
    assert gather_records.shapes_of(header.reshape(1, -1)) == [(5, 2, 7)]
    assert gather_records.describe(np.stack([header, gather_records.header_of(
        np.zeros((1, 3), np.int64))])) == ("rank 0: shape=(5, 2, 7) dtype=float32, "
                                           "rank 1: shape=(1, 3) dtype=int64")
