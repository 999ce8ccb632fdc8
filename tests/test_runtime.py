"""JSON-lines logs that survive a process killed mid-write, and files that are not logs at all (issue 20)."""

import json
import subprocess
import sys

import pytest

from toolcollapse.runtime import read_jsonl


def test_a_torn_last_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lr"')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    assert f"{path}:3: not a JSON record, skipped" in capsys.readouterr().err


@pytest.mark.parametrize("line", ["[" * 100_000, "[1, 2]", '"text"', "garbage", '{"a": 1'],
                         ids=["nested past the recursion limit", "a list", "a string", "garbage", "torn"])
def test_lines_that_are_not_records_are_marked_not_raised(tmp_path, line):
    from toolcollapse.runtime import jsonl_lines

    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 0}\n' + line + '\n{"step": 1}\n')
    assert [(n, r) for n, _, r in jsonl_lines(path)] == [(1, {"step": 0}), (2, None), (3, {"step": 1})]
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029"])
def test_a_record_whose_strings_hold_unicode_line_breaks_is_one_line(tmp_path, char):
    """A model's text may hold U+0085 or U+2028, which str.splitlines() breaks at (the fuzz test found it):
    records are split at "\n" only, so the resumed run keeps its samples."""
    from toolcollapse.runtime import write_jsonl

    path = tmp_path / "samples.jsonl"
    records = [{"step": 0, "text": f"a{char}b"}, {"step": 1, "text": "c"}]
    write_jsonl(path, records)
    assert read_jsonl(path) == records


def test_a_binary_file_is_refused_naming_the_byte(tmp_path):
    from toolcollapse.runtime import NotTextError

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0}\n\xff\xfe\x00binary')
    with pytest.raises(NotTextError, match=r"byte 12 is 0xff, not UTF-8"):
        read_jsonl(path)


def _run_dir(tmp_path, metrics: bytes):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("grpo:\n  steps: 3\n")
    (run / "metrics.jsonl").write_bytes(metrics)
    return run


def _diagnose(run):
    return subprocess.run([sys.executable, "-m", "toolcollapse.cli", "diagnose", str(run), "--no-figures"],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_diagnose_on_a_binary_log_exits_2_with_a_message(tmp_path):
    proc = _diagnose(_run_dir(tmp_path, bytes(range(256)) * 8))
    assert proc.returncode == 2 and "not a JSON-lines text file" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_diagnose_skips_a_line_nested_past_the_recursion_limit(tmp_path):
    rows = [{"step": s, "healthy_rate": 0.9, "reward_mean": 0.1, "frac_groups_informative": 0.5} for s in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows[:2]) + "[" * 200_000 + "\n" + json.dumps(rows[2]) + "\n"
    proc = _diagnose(_run_dir(tmp_path, text.encode()))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 steps" in proc.stdout and "metrics.jsonl:3: not a JSON record, skipped" in proc.stderr


def test_a_checkpoint_without_tokenizer_files_names_them(tmp_path):
    from toolcollapse.model import CheckpointError, load_tokenizer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no tokenizer there \(tokenizer.json / tokenizer.model"):
        load_tokenizer(tmp_path)


@pytest.mark.slow
def test_eval_of_a_checkpoint_without_its_tokenizer_exits_2_naming_the_files(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path / "ckpt")  # weights and config, no tokenizer files
    proc = subprocess.run([sys.executable, "-m", "toolcollapse.cli", "eval", str(tmp_path / "ckpt"), "--n", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "no tokenizer there (tokenizer.json / tokenizer.model" in proc.stderr
