import numpy as np
import pytest
import torch

from elastictrain.config import DataConfig
from elastictrain.errors import DataError
from elastictrain.runtime import sample_corpus
from elastictrain.runtime.data import SAMPLE_CORPUS, SyntheticSource, build_source


def test_synthetic_source_is_deterministic_and_learnable_shape():
    a = SyntheticSource(1000, 16, 256, seed=1).batch([3, 4, 999])
    b = SyntheticSource(1000, 16, 256, seed=1).batch([3, 4, 999])
    c = SyntheticSource(1000, 16, 256, seed=2).batch([3, 4, 999])
    assert a.shape == (3, 17) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.max()) < 256 and int(a.min()) >= 0
    # each row is an arithmetic progression mod vocab: the next token is predictable from the previous two
    d = (a[:, 1:] - a[:, :-1]) % 256
    assert bool((d == d[:, :1]).all())


def test_sample_corpus_is_reproduced_by_its_generator():
    assert SAMPLE_CORPUS.read_text() == sample_corpus.generate()


def test_text_source_reads_byte_windows(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(bytes(range(100)))
    src = build_source(DataConfig(source="text", path=str(p), seq_len=10), vocab_size=256, seed=0)
    assert src.num_samples == 9
    assert src.batch([2]).tolist() == [list(range(20, 31))]


def test_token_file_checks_vocab(tmp_path):
    p = tmp_path / "t.bin"
    np.arange(0, 500, dtype=np.uint16).tofile(p)
    src = build_source(DataConfig(source="tokens", path=str(p), seq_len=10, token_dtype="uint16"), 1000, 0)
    assert src.batch([1]).tolist() == [list(range(10, 21))]
    small = build_source(DataConfig(source="tokens", path=str(p), seq_len=10, token_dtype="uint16"), 100, 0)
    with pytest.raises(DataError, match="vocab_size"):
        small.batch([40])


def test_missing_or_tiny_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_source(DataConfig(source="text", path=str(tmp_path / "no.txt")), 256, 0)
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(DataError, match="fewer than one sample"):
        build_source(DataConfig(source="text", path=str(tmp_path / "tiny.txt"), seq_len=64), 256, 0)
    with pytest.raises(DataError, match="vocab_size >= 256"):
        build_source(DataConfig(source="text", path="sample"), 100, 0)
