import pytest

from pipelines.spec import JobSpec, SpecError, load_spec


def test_defaults_describe_a_laptop_run():
    s = JobSpec()
    assert s.services.spark_master == "local[*]"
    assert s.launcher.nproc_per_node == 2 and s.launcher.kind == "local"
    assert s.services.mlflow_tracking_uri == "sqlite:///var/mlflow.db"
    assert s.services.s3_endpoint_url is None  # embedded endpoint
    assert s.checkpoint.l0 == "var/tiers/nvme" and s.checkpoint.l1 == "var/tiers/shared"


def test_yaml_overrides_and_env(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("train:\n  steps: 7\nmodel:\n  d_model: 64\n  n_heads: 4\n")
    s = load_spec(p, ["train.lr=0.01", "data.inputs=[a.jsonl, b.jsonl]"], env={"SPARK_MASTER": "spark://h:7077"})
    assert s.train.steps == 7 and s.model.d_model == 64 and s.train.lr == 0.01
    assert s.data.inputs == ["a.jsonl", "b.jsonl"]
    assert s.services.spark_master == "spark://h:7077"


def test_errors_name_the_key_to_fix(tmp_path):
    with pytest.raises(SpecError, match=r"train\.steps"):
        load_spec(None, ["train.steps=0"], env={})
    with pytest.raises(SpecError, match=r"model\.d_model=100 is not divisible by model\.n_heads=3"):
        load_spec(None, ["model.d_model=100", "model.n_heads=3"], env={})
    with pytest.raises(SpecError, match="exceeds dedup.num_perm"):
        load_spec(None, ["data.dedup.bands=20", "data.dedup.rows=10"], env={})
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "missing.yaml", env={})
    with pytest.raises(SpecError, match=r"trian"):
        load_spec(None, ["trian.steps=3"], env={})  # unknown section
    # a model name goes into the registry's search filters and models:/ URIs: a quote broke the filter (a traceback)
    for bad in ("it's", "a/b", "m@champion", ""):
        with pytest.raises(SpecError, match=r"registry\.model_name: .* is not a model name"):
            load_spec(None, [f"registry.model_name={bad}"], env={})
    with pytest.raises(SpecError, match=r"registry\.alias: 'latest' is not an alias"):
        load_spec(None, ["registry.alias=latest"], env={})
    assert load_spec(None, ["registry.model_name=My model-2.1"], env={}).registry.model_name == "My model-2.1"
    # a run name is a path component of every tier and of L2's keys: '..' or '/x' put checkpoints, lineage records
    # and retirement's deletions outside checkpoint.l1 (Path joins an absolute part as a new root)
    for bad in ("..", "../x", "/abs", "a/b", ".hidden", "-x", "a b", "", "x" * 201):
        with pytest.raises(SpecError, match=r"run\.name: .* is not a run name"):
            load_spec(None, [f"run.name={bad}"], env={})
    assert load_spec(None, ["run.name=My_Run.v2-7b"], env={}).run.name == "My_Run.v2-7b"


def test_stage_hash_depends_only_on_the_sections_a_stage_reads():
    a, b = JobSpec(), load_spec(None, ["train.steps=999"], env={})
    assert a.stage_hash("dedup") == b.stage_hash("dedup")
    assert a.stage_hash("train") != b.stage_hash("train")
    c = load_spec(None, ["data.dedup.num_perm=64"], env={})
    assert a.stage_hash("dedup") != c.stage_hash("dedup")


def test_a_stage_output_is_reused_only_for_the_same_config_and_inputs_even_with_an_explicit_output(tmp_path):
    from pipelines.manifest import StageDir, run_stage

    runs = []

    def stage(inputs, config="c"):
        sd = StageDir(tmp_path / "runs", "s", config, inputs, out_dir=str(tmp_path / "out"))

        def body(tmp):
            runs.append(1)
            (tmp / "o.txt").write_text(str(inputs))
            return sd.commit({"o": "o.txt"})

        return run_stage(sd, body, log=lambda m: None)

    a = [{"uri": "file:///a", "sha256": "1"}]
    stage(a)
    stage(a)
    assert len(runs) == 1  # reused
    stage([{"uri": "file:///a", "sha256": "2"}])  # same --output, changed input
    assert len(runs) == 2
    stage([{"uri": "file:///a", "sha256": "2"}], config="d")
    assert len(runs) == 3
