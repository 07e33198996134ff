"""docs/config_reference.md: every key of every entry point's config has a doc, and the file is up to date."""

from nemo_grpo import config_reference
from nemo_grpo.config import DTensorConfig, EvalDataConfig, GRPOConfig, MasterConfig


def test_every_key_has_a_doc():
    missing = config_reference.missing_docs()
    assert not missing, ("config keys without a doc (a trailing `# comment` on the field's line, or comment lines "
                         "right above it; a section needs a class docstring):\n  " + "\n  ".join(missing))


def test_reference_is_up_to_date():
    path = config_reference.OUTPUT
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    assert current == config_reference.render(), (
        f"{path} is {'missing' if current is None else 'stale'}: run `python -m nemo_grpo.config_reference` "
        "(make config-reference)")


def test_docs_come_from_the_source_comments():
    assert config_reference.field_doc(GRPOConfig, "val_period") == "0 disables periodic validation"  # trailing
    assert config_reference.field_doc(DTensorConfig, "data_parallel_size").startswith("data-parallel (FSDP2)")  # above
    inherited = config_reference.field_doc(DTensorConfig, "moe_aux_loss_coeff")  # from RouterLossConfig's source
    assert inherited.startswith("the load-balancing loss's weight")
    assert config_reference.field_doc(EvalDataConfig, "split").startswith("HF datasets only")  # DatasetConfig's
    assert config_reference.first_sentence(GRPOConfig).startswith("grpo: the GRPO loop")


def test_walk_gives_every_dotted_key_with_its_type_and_default():
    sections = config_reference.walk(MasterConfig, MasterConfig())
    rows = {key: (tp, default) for section in sections for key, tp, default, _ in section.rows}
    assert rows["policy.generation.vllm_cfg.tensor_parallel_size"] == ("int", "1")
    assert rows["policy.optimizer.betas"] == ("list[float]", "[0.9, 0.999]")
    assert rows["policy.generation.stop_strings"] == ("Optional[list[str]]", "null")
    assert rows["env.code.reward_mode"] == ("str", "fraction")  # an optional section (default null): its class defaults
    assert rows["checkpointing.enabled"] == ("bool", "true")


def test_check_reports_a_stale_file(tmp_path):
    stale = tmp_path / "config_reference.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert any("stale" in problem for problem in config_reference.check(stale))
    assert config_reference.main(["--check", "--output", str(stale)]) == 1
    assert config_reference.main(["--output", str(stale)]) == 0
    assert config_reference.check(stale) == [] and config_reference.main(["--check", "--output", str(stale)]) == 0


def test_a_key_without_a_doc_is_named(monkeypatch):
    real = config_reference.field_doc
    monkeypatch.setattr(config_reference, "field_doc",
                        lambda cls, name: "" if (cls, name) == (GRPOConfig, "seed") else real(cls, name))
    missing = config_reference.missing_docs()
    assert "MasterConfig: grpo.seed" in missing and len(missing) == 1
    assert "no doc for MasterConfig: grpo.seed" in config_reference.check()
