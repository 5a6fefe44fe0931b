"""Any lm-eval task: a task YAML of the user's own (eval.include_path) over a local JSONL is decontaminated through
lm-eval's task objects and scored by the evaluation; a task that cannot be built offline, or an unknown name, fails
the spec check in one line that names it."""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before anything imports datasets
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from conftest import c4_docs, write_jsonl  # noqa: E402
from pipelines.data import decontaminate as dc  # noqa: E402
from pipelines import eval_sets as task_files  # noqa: E402
from pipelines.eval import harness, scorer  # noqa: E402
from pipelines.spec import DecontaminateCfg, SpecError, load_spec  # noqa: E402
from test_eval import models  # noqa: E402,F401 - the two tiny random models (and their SentencePiece model)

# PIQA's shape (goal, sol1, sol2, label) and upstream piqa.yaml's prompt, target and choices
PIQA = [
    {"goal": "How do I keep the lid of a jar of homemade jam from sticking to the rim after opening it",
     "sol1": "Wipe the rim clean with a damp cloth before screwing the lid back on.",
     "sol2": "Pour a little more jam onto the rim before screwing the lid back on.", "label": 0},
    {"goal": "To make a paper airplane glide farther across a large classroom without stalling",
     "sol1": "crumple the paper into a tight ball and throw it as hard as you can",
     "sol2": "fold the wings so they are level and launch it gently slightly upward", "label": 1},
    {"goal": "How can you cool down a hot bowl of tomato soup quickly before serving it to children",
     "sol1": "Stir it with a cold metal spoon and leave it by an open window for a few minutes.",
     "sol2": "Put the bowl in a preheated oven at a low temperature for a few minutes.", "label": 0},
    {"goal": "Remove a stubborn sticker label from a glass bottle you want to reuse for olive oil",
     "sol1": "Soak the bottle in warm soapy water for an hour and rub the softened glue off with a sponge.",
     "sol2": "Freeze the bottle overnight and then tap the frozen label with a hammer until it shatters.", "label": 0},
    {"goal": "How do you stop a wooden cutting board from cracking after it has been washed many times",
     "sol1": "Leave it soaking in the sink overnight so that the wood stays wet.",
     "sol2": "Rub it with food grade mineral oil once a month and let it dry standing up.", "label": 1},
    {"goal": "Keep brown sugar in the pantry from turning into a hard solid lump over the winter",
     "sol1": "Store it in an airtight container with a slice of bread or a damp terracotta disc.",
     "sol2": "Store it in an open paper bag on top of the warm refrigerator.", "label": 0},
]

YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
training_split: null
validation_split: validation
test_split: null
doc_to_text: "Question: {{{{goal}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2]}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture
def task_dir(tmp_path):
    """A folder of task YAMLs as a user writes them: piqa_local over a local JSONL, piqa_gone over a missing one."""
    d = tmp_path / "my_tasks"
    d.mkdir()
    data = write_jsonl(tmp_path / "piqa_valid.jsonl", PIQA)
    (d / "piqa_local.yaml").write_text(YAML.format(name="piqa_local", data=data))
    (d / "piqa_gone.yaml").write_text(YAML.format(name="piqa_gone", data=tmp_path / "nowhere.jsonl"))
    return d


def _spec(task_dir, *tasks: str, **sets):
    return load_spec(None, [f"eval.tasks={json.dumps(list(tasks))}", f"eval.include_path={json.dumps([str(task_dir)])}",
                            *[f"{k}={v}" for k, v in sets.items()]], env={})


def test_a_planted_item_of_a_users_task_is_removed_through_lm_evals_task_objects(task_dir):
    items, ident = dc.eval_items(_spec(task_dir, "piqa_local"))
    assert set(items) == {"piqa_local", "reference"} and len(items["piqa_local"]) == len(PIQA)
    task = task_files.eval_tasks(_spec(task_dir, "piqa_local"))["piqa_local"]
    assert ident["piqa_local"] == {"sha256": task_files.task_digest(task)}  # the record's identity = the evaluation's
    # the item as the evaluation shows it (lm-eval's prompt + the correct solution) and its goal, without the labels
    first = items["piqa_local"][0]
    assert isinstance(first[0], dc.Layout) and first[0] == f"Question: {PIQA[0]['goal']}\nAnswer: {PIQA[0]['sol1']}"
    assert PIQA[0]["goal"] in first and not any(PIQA[0]["sol2"] in t for t in first)  # a wrong solution is no evidence
    clean = [{"id": f"clean-{i}", "text": d["text"]} for i, d in enumerate(c4_docs(300))]
    item = PIQA[3]
    planted = {"id": "planted", "text": f"{clean[0]['text'][:300]}\n\nKITCHEN HACK #12 -- {item['goal'].upper()}? "
                                        f"{item['sol1']}\n\n{clean[1]['text'][:300]}"}
    wrong = {"id": "wrong", "text": f"{clean[2]['text'][:200]} {PIQA[5]['sol2']} {clean[3]['text'][:200]}"}
    table, lengths, stats = dc.build_table(items, 13, 8)
    assert stats["piqa_local"] == {"items": len(PIQA), "items_too_short": 0}
    order = list(items)
    decided = {d["id"]: dc.decide(d["text"], table, lengths, DecontaminateCfg(), order)
               for d in clean + [planted, wrong]}
    removed = {i: r for i, r in decided.items() if r[0] is not None}
    assert list(removed) == ["planted"] and removed["planted"][0] == "contamination:piqa_local"
    assert "piqa_local:3" in removed["planted"][2]


def test_the_evaluation_reads_the_decontamination_record_of_the_same_items(task_dir):
    """evaluate's digest of a task is the decontaminate record's: the model's contamination count and the metrics'
    MLflow dataset are per task, whatever its data source."""
    from types import SimpleNamespace

    from pipelines.eval import registry
    from pipelines.eval.evaluate import model_contamination, task_inputs

    spec = _spec(task_dir, "piqa_local")
    ident = dc.eval_items(spec)[1]
    digests = task_inputs(spec)[0]
    assert digests == {"piqa_local": ident["piqa_local"]["sha256"]}
    record = {"piqa_local": {**ident["piqa_local"], "complete": True, "items": len(PIQA), "overlapping_kept": [3, 5],
                             "docs_removed": 1, "ngram": 13}}
    con = model_contamination(spec, SimpleNamespace(extra={"contamination": record}), digests)
    assert con["piqa_local"]["items_overlapping"] == 2 and con["piqa_local"]["scored_overlapping"] == 2
    assert con["reference"] == {"checked": False}
    other = model_contamination(spec, SimpleNamespace(extra={"contamination": {
        "piqa_local": {**record["piqa_local"], "sha256": "0" * 64}}}), digests)
    assert other["piqa_local"] == {"checked": False}  # a record of other items says nothing of these
    sets = registry.datasets({"reference_sha256": "r" * 64, "task_sha256": digests})
    assert sets["harness.piqa_local."] == ("piqa_local", digests["piqa_local"][:12])


def test_the_evaluation_scores_a_users_task(task_dir, models):
    spec = _spec(task_dir, "piqa_local", **{"eval.limit": 4})
    out = scorer.score(spec, scorer.Job(model_dir=str(models[0]), parts=["harness"]))
    res = out["harness"]["results"]
    assert res["n-samples"]["piqa_local"]["effective"] == 4
    assert out["harness"]["scores"]["harness.piqa_local.acc"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert res["config"]["include_path"] == [str(task_dir)]


def test_a_task_whose_data_is_missing_fails_the_spec_check_in_one_line(task_dir, tmp_path, capsys):
    with pytest.raises(SpecError) as e:
        task_files.eval_tasks(_spec(task_dir, "piqa_local", "piqa_gone"))
    msg = str(e.value)
    assert msg.startswith("eval.tasks: task 'piqa_gone' cannot be used offline: ") and "\n" not in msg
    assert str(tmp_path / "nowhere.jsonl") in msg
    # the harness CLI says the same before it opens any model, exit 2
    rc = harness.main(["--model-uri", str(tmp_path / "no-model"), "--tasks", "piqa_gone", "--include-path",
                       str(task_dir), "--output", str(tmp_path / "r.json")])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness:")]  # past datasets' bars
    assert rc == 2 and len(said) == 1 and said[0].startswith("harness: eval.tasks: task 'piqa_gone' cannot be used")
    with pytest.raises(SpecError, match=r"eval.include_path: no such folder"):
        task_files.eval_tasks(_spec(tmp_path / "no-such-dir", "piqa_local"))


def test_an_unknown_name_is_refused_with_close_matches_and_the_field_check_stays_cheap(task_dir):
    with pytest.raises(SpecError) as e:
        task_files.eval_tasks(_spec(task_dir, "piqa_locl"))  # lm-eval's own index: built once per process
    msg = str(e.value)
    assert msg.startswith("eval.tasks: unknown task 'piqa_locl'") and "piqa_local" in msg and "\n" not in msg
    # the spec's field check only sees malformed lists; which names lm-eval knows is the stages' check
    assert _spec(task_dir, "not_a_task_yet").eval.tasks == ["not_a_task_yet"]
    with pytest.raises(SpecError, match="listed more than once"):
        _spec(task_dir, "piqa_local", "piqa_local")


def test_headline_takes_every_metric_and_filter_lm_eval_reports():
    res = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match":
                                 0.1, "exact_match,flexible-extract": 0.5},
                       "llmp_arc_easy": {"acc,none": 0.4, "acc_stderr,none": 0.05, "acc_norm,none": 0.45}}}
    assert harness.headline(res) == {"harness.gsm8k.exact_match.strict-match": 0.25,
                                     "harness.gsm8k.exact_match.flexible-extract": 0.5,
                                     "harness.llmp_arc_easy.acc": 0.4, "harness.llmp_arc_easy.acc_norm": 0.45}


def test_a_tasks_settings_are_in_evaluates_key_and_not_in_the_decontamination_record(task_dir, tmp_path):
    """num_fewshot none → 5, or acc → brier_score, in the user's YAML: the same items (decontaminate's record and its
    key stay), another evaluate key (it re-runs)."""
    from pipelines.eval.evaluate import task_inputs

    base = (task_dir / "piqa_local.yaml").read_text()
    variants = {"fewshot": base.replace("metadata:", "num_fewshot: 5\nmetadata:"),
                "brier": base.replace("metric: acc", "metric: brier_score")}
    keys, idents = {}, {}
    for name, text in [("base", base), *variants.items()]:
        d = tmp_path / name
        d.mkdir()
        (d / "piqa_local.yaml").write_text(text)
        spec = _spec(d, "piqa_local")
        digests, refs = task_inputs(spec)
        assert [r["items_sha256"] for r in refs] == [digests["piqa_local"]]
        ident = dc.eval_items(spec)[1]
        keys[name], idents[name] = refs[0]["sha256"], dc.eval_refs(spec, ident)[0]
        assert idents[name] == {"uri": "lm-eval:piqa_local", "sha256": digests["piqa_local"]}
    assert len(set(keys.values())) == 3 and len({i["sha256"] for i in idents.values()}) == 1
    twice = _spec(tmp_path / "base", "piqa_local")
    assert task_inputs(twice)[1][0]["sha256"] == keys["base"]  # built again: the same key


def test_task_settings_hold_no_memory_address_so_every_process_writes_the_same_text():
    """lm-eval's dump_config keeps a function nested in fewshot_config as the object: its repr holds an address."""
    tasks = task_files.build_tasks(["llmp_hellaswag"], "data/eval")
    text = task_files.task_settings(tasks["llmp_hellaswag"])
    assert " at 0x" not in text and "def hellaswag_process_docs" in text and "config_source" not in text
    assert json.loads(text)["lm_eval"] and json.loads(text)["config"]["task"] == "llmp_hellaswag"
    assert task_files.settings_value(object()) == "<object object>"


class _Manager:
    """A TaskManager whose load raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def load(self, names):
        raise self.error


def _cannot_build(monkeypatch, error: BaseException):
    monkeypatch.setattr(task_files, "manager_for", lambda *a, **k: _Manager(error))
    return task_files.build_tasks(["piqa_x"])


def test_only_the_specs_faults_are_spec_errors_the_machines_are_raised_for_a_retry(monkeypatch):
    import filelock
    from datasets.exceptions import DatasetGenerationError

    for spec_fault in [FileNotFoundError("Unable to find '/data/x.jsonl'"), ValueError("bad doc_to_text"),
                       ConnectionError("Couldn't reach 'piqa' on the Hub (OfflineModeIsEnabled)")]:
        with pytest.raises(SpecError, match=r"eval.tasks: task 'piqa_x' cannot be used offline"):
            _cannot_build(monkeypatch, spec_fault)
    built = DatasetGenerationError("An error occurred while generating the dataset")
    built.__cause__ = OSError(28, "No space left on device")
    for machine in [filelock.Timeout("/hf/cache/datasets/_json.lock"), OSError(5, "Input/output error"), built,
                    PermissionError(13, "Permission denied")]:
        with pytest.raises(type(machine)):
            _cannot_build(monkeypatch, machine)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ConnectionError):  # online, an unreachable hub is an outage, not the spec
        _cannot_build(monkeypatch, ConnectionError("Couldn't reach 'piqa' on the Hub"))
    import httpx
    import httpx2

    # the hub's own form (huggingface_hub's client is httpx2): "not found locally", a FileNotFoundError, raised while
    # handling the transport error (its context, not its cause); was read as the spec's fault (2, never retried)
    for client in (httpx2, httpx):
        try:
            try:
                raise client.ReadTimeout("timed out")
            except client.ReadTimeout:
                raise FileNotFoundError("LocalEntryNotFoundError: cannot find the file in the local cache")
        except FileNotFoundError as e:
            hub = e
        with pytest.raises(FileNotFoundError):
            _cannot_build(monkeypatch, hub)
        assert task_files.spec_fault(hub) is False


def test_a_reference_file_that_is_not_what_it_says_is_one_line_naming_it(tmp_path):
    """eval.reference: a torn JSONL line, a record that is not an object, one without text (it checked nothing,
    silently) and a file that is not UTF-8 were tracebacks (or an empty item); each is now a SpecError (2)."""
    cases = {"torn.jsonl": '{"text": "a"}\n{"text": "b', "list.jsonl": "[1, 2]\n", "untexted.jsonl": '{"t": "x"}\n',
             "latin1.txt": "caf\xe9".encode("latin-1")}
    for name, body in cases.items():
        p = tmp_path / name
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
        with pytest.raises(SpecError, match=name.replace(".", r"\.")):
            task_files.reference_items([p])
    (tmp_path / "ok.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "ok.txt").write_text("para one\n\npara two\n")
    assert task_files.reference_items([tmp_path / "ok.jsonl", tmp_path / "ok.txt"]) == [
        ["one"], ["two"], ["para one"], ["para two\n"]]
