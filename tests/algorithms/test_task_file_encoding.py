"""A prompts file with a byte that is not UTF-8 is an error naming the file and line."""

from __future__ import annotations

import pytest

from phalanx.algorithms.grpo_tasks import load_jsonl


def test_a_non_utf8_byte_names_file_line_and_column(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"prompt": "1+1", "answer": 2}\n\n{"prompt": "caf\xe9", "answer": 3}\n')
    with pytest.raises(ValueError) as info:
        load_jsonl(str(path))
    assert str(info.value) == f"{path}:3: not UTF-8 text (byte 0xe9 at column 16)"


def test_utf8_text_and_windows_line_ends_still_load(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes('{"prompt": "café", "answer": 2}\r\n'.encode())
    [example] = load_jsonl(str(path))
    assert (example.prompt, example.answer) == ("café", "2")
