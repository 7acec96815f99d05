import gzip
import json

import pytest
from django.core.management import CommandError, call_command

from leaderboard.models import Prompt, PromptSet


def count_lines(path):
    return sum(1 for line in open(path) if line.strip())


@pytest.mark.parametrize("name, fmt, n, categories", [
    ("mt_bench.jsonl", "mt-bench", 80, 8),
    ("mt_bench_spec.jsonl", "spec-bench", 80, 8),
    ("humaneval.jsonl.gz", "humaneval", 164, 1),
    ("humaneval.jsonl", "spec-bench", 164, 1),
    ("mixed.jsonl", "spec-bench", 12, 2),
])
@pytest.mark.django_db
def test_every_format_imports(prompt_files, name, fmt, n, categories):
    path = prompt_files / name
    call_command("import_prompts", str(path), "--format", fmt, "--slug", "set")
    prompt_set = PromptSet.objects.get(slug="set")
    assert prompt_set.prompts.count() == n
    assert prompt_set.prompts.values("category").distinct().count() == categories
    if fmt != "humaneval":
        first = json.loads(open(path).readline())
        stored = prompt_set.prompts.order_by("position").first()
        assert stored.turns == first["turns"] and stored.category == first["category"]


@pytest.mark.django_db
def test_importing_the_same_file_twice_adds_nothing(prompt_files):
    path = prompt_files / "mt_bench.jsonl"
    call_command("import_prompts", str(path), "--format", "mt-bench", "--slug", "qa")
    call_command("import_prompts", str(path), "--format", "mt-bench", "--slug", "qa")
    assert PromptSet.objects.count() == 1 and Prompt.objects.count() == count_lines(path)


@pytest.mark.django_db
def test_humaneval_gzip_imports(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}",
             "canonical_solution": "", "test": ""} for i in range(3)]
    path.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    call_command("import_prompts", str(path), "--format", "humaneval", "--slug", "he")
    assert list(Prompt.objects.values_list("external_id", flat=True)) == [
        "HumanEval/0", "HumanEval/1", "HumanEval/2"]


GOOD = json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]})


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "line 3: is not valid JSON"),
    (json.dumps({"question_id": 3, "turns": ["x"]}), "line 3: missing field(s) category"),
    (json.dumps({"question_id": 3, "category": "qa", "turns": []}), "line 3: turns must be a non-empty list"),
    (json.dumps({"question_id": 3, "category": "qa", "turns": ["ok", 5]}), "line 3: turn 2 must be a non-empty string"),
    (json.dumps({"question_id": 1, "category": "qa", "turns": ["dup"]}), "line 3: duplicate id '1' (first on line 1)"),
    ("[1, 2]", "line 3: must be a JSON object"),
])
@pytest.mark.django_db
def test_malformed_file_is_refused_with_its_line_and_nothing_is_written(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    second = json.dumps({"question_id": 2, "category": "qa", "turns": ["Ok?"]})
    path.write_text("\n".join([GOOD, second, bad_line, GOOD.replace('"question_id": 1', '"question_id": 9')]) + "\n")
    with pytest.raises(CommandError) as info:
        call_command("import_prompts", str(path), "--format", "spec-bench")
    assert message in str(info.value) and "Nothing was imported" in str(info.value)
    assert PromptSet.objects.count() == 0 and Prompt.objects.count() == 0


@pytest.mark.django_db
def test_a_different_file_under_an_existing_slug_is_refused(tmp_path, prompt_files):
    call_command("import_prompts", str(prompt_files / "mt_bench_spec.jsonl"), "--format",
                 "spec-bench", "--slug", "qa")
    with pytest.raises(CommandError, match="already exists from a different file"):
        call_command("import_prompts", str(prompt_files / "mixed.jsonl"), "--format",
                     "spec-bench", "--slug", "qa")
    assert PromptSet.objects.count() == 1
