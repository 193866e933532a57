"""Reading local datasets: JSON lines, Parquet and save_to_disk give the same rows; what is missing is one line."""

import pytest

from elastictrain.config import DataConfig
from elastictrain.errors import ConfigError, DataError
from elastictrain.runtime.rows import read_rows
from tests.fixtures.sft import chat_rows, write_hf_disk, write_jsonl, write_parquet

ROWS = chat_rows(7)


@pytest.mark.parametrize("source", ["jsonl", "parquet", "hf_disk", "hf_disk_split"])
def test_every_format_reads_the_same_rows_in_file_order(tmp_path, source):
    p = tmp_path / "data"
    if source == "jsonl":
        write_jsonl(p, ROWS)
    elif source == "parquet":
        write_parquet(p, ROWS)
    else:
        write_hf_disk(p, ROWS, split="train" if source == "hf_disk_split" else None)
    assert read_rows(DataConfig(source=source.removesuffix("_split"), path=str(p))) == ROWS


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_missing_file_is_one_line_naming_data_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        read_rows(DataConfig(source="jsonl", path=str(tmp_path / "nope.jsonl")))
    assert one_line(e).startswith(f"data.path='{tmp_path}/nope.jsonl' does not exist; point data.path at")


@pytest.mark.parametrize("fmt, row, field", [
    ("chat", {"prompt": "a"}, "data.prompt_field / data.response_field"),
    ("chat", {"question": "a", "answer": "b"}, "data.messages_field"),
    ("text", {"prompt": "a"}, "data.text_field"),
])
def test_a_missing_column_is_one_line_naming_the_field(tmp_path, fmt, row, field):
    p = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(ConfigError) as e:
        read_rows(DataConfig(source="jsonl", path=str(p), format=fmt))
    assert field in one_line(e)


def test_a_column_missing_from_a_later_row_names_that_row(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}] * 3 + [{"prompt": "a"}])
    with pytest.raises(ConfigError, match=r"row 3 has no column 'response' \(data.prompt_field / data.response"):
        read_rows(DataConfig(source="jsonl", path=str(p)))


def test_a_broken_json_line_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": \n')
    with pytest.raises(DataError, match=r"d.jsonl:3: not a JSON object"):
        read_rows(DataConfig(source="jsonl", path=str(p), format="text"))


def test_an_unknown_split_names_the_splits_there(tmp_path):
    p = write_hf_disk(tmp_path / "ds", ROWS, split="train")
    with pytest.raises(ConfigError, match=r"data.split='test' is not a split .* \(it has train\)"):
        read_rows(DataConfig(source="hf_disk", path=str(p), split="test"))
