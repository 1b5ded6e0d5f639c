"""executor/gguf_index.py against the gguf package's GGUFReader on a small file written with GGUFWriter: every
field's value (scalars of each type, strings, numeric and string arrays, an array of arrays skipped over), and
every tensor's name, type, shape, byte count and data (float and block types); a file that is not GGUF, or is cut
short, is an error."""

from __future__ import annotations

import numpy as np
import pytest

from radixgen.runtime.executor.gguf_index import GGUFIndex, GGUFIndexError

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def write(path) -> None:
    gen = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -5)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "bc", ""])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("f32", gen.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", gen.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("vec", np.ones(5, np.float32))
    w.add_tensor("q8", gguf.quants.quantize(gen.standard_normal((2, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("q4k", gen.integers(0, 256, (3, 144), dtype=np.uint8), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_index_reads_what_gguf_reader_reads(tmp_path):
    path = tmp_path / "t.gguf"
    write(path)
    ours, theirs = GGUFIndex(path), gguf.GGUFReader(str(path))
    for key, f in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own header entries
            continue
        if key != "t.nested":
            assert ours.fields[key].contents() == f.contents(), key
    assert ours.fields["t.str"].contents() == "héllo" and ours.fields["t.strs"].contents() == ["a", "bc", ""]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape) and a.n_bytes == int(b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    assert ours.tensors[3].data.shape == (2, 68)  # Q8_0 rows of two 34-byte blocks
    ours.tensors[0].data[0, 0] = 1.0  # a copy-on-write map: the file is not written
    assert np.array_equal(GGUFIndex(path).tensors[0].data, theirs.tensors[0].data)


def test_not_gguf_or_cut_short_is_an_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFIndexError, match="is not a GGUF file"):
        GGUFIndex(bad)
    path = tmp_path / "t.gguf"
    write(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(GGUFIndexError, match="cut short or corrupt"):
        GGUFIndex(cut)
    cut.write_bytes(path.read_bytes()[:-100])  # the header whole, the last tensor's data not
    with pytest.raises(GGUFIndexError, match="'q4k' runs past the end"):
        GGUFIndex(cut)
