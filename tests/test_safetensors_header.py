"""The one safetensors header validator (worker/safetensors_header.py) in both of its call
styles: the upload validation collects every problem (``add`` appends), the pre-flight
check before an engine loads a drafter (``validate_drafter_files``) raises at the first,
with a one-line message that names the file. Same rules, same words."""
import json
import struct

import pytest

from worker.measure import DrafterSpec
from worker.methods import DrafterCheckpointError, validate_drafter_files
from worker.safetensors_header import check_safetensors_header


def raw_safetensors(header, data=b""):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data


def T(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": T("F32", [2, 2], 0, 16), "b": T("BF16", [4], 16, 24)}
# case: (file bytes, the field of the first problem, words of its message)
CASES = {
    "truncated": (raw_safetensors(GOOD, b"\0" * 20), "b.data_offsets", "truncated"),
    "too_short_for_a_header": (b"\0" * 4, "header_length", "too short"),
    "trailing_bytes": (raw_safetensors(GOOD, b"\0" * 40), "data_offsets", "trailing"),
    "bad_dtype": (raw_safetensors({"a": T("F17", [4], 0, 8)}, b"\0" * 8), "a.dtype",
                  "unknown dtype 'F17'"),
    "offsets_do_not_match_shape": (raw_safetensors({"a": T("F32", [2, 3], 0, 16)}, b"\0" * 16),
                                   "a.data_offsets", "needs 24 bytes"),
    "no_tensors": (raw_safetensors({"__metadata__": {"format": "pt"}}), "header", "no tensors"),
    "no_tensors_but_data": (raw_safetensors({}, b"\0" * 8), "header", "no tensors but 8 bytes"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_collecting_call_style_reports_the_problem(case, tmp_path):
    blob, field, words = CASES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    problems = []
    assert check_safetensors_header(path, lambda f, m: problems.append((f, m))) is None
    assert problems[0][0] == field and words in problems[0][1], problems


@pytest.mark.parametrize("case", sorted(CASES))
def test_raising_call_style_names_the_file_and_the_same_problem(case, tmp_path):
    blob, field, words = CASES[case]
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(blob)
    with pytest.raises(DrafterCheckpointError) as err:
        validate_drafter_files(DrafterSpec("draft_model", str(folder)))
    message = str(err.value)
    assert message.startswith(f"{folder / 'model.safetensors'} [{field}]: ")
    assert words in message and len(message.splitlines()) == 1


def test_a_sound_file_passes_both_call_styles(tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(raw_safetensors(GOOD, b"\0" * 24))
    problems = []
    found = check_safetensors_header(folder / "model.safetensors",
                                     lambda f, m: problems.append((f, m)))
    assert problems == [] and found == {"a": ("F32", [2, 2]), "b": ("BF16", [4])}
    validate_drafter_files(DrafterSpec("draft_model", str(folder)))


def test_the_collecting_style_reports_every_problem_of_a_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw_safetensors({"a": T("F17", [4], 0, 8), "b": T("F32", [-1], 8, 8)},
                                     b"\0" * 8))
    problems = []
    check_safetensors_header(path, lambda f, m: problems.append((f, m)))
    assert [f for f, _ in problems] == ["a.dtype", "b.shape"]
