"""position_lr.py: the position parameters' own learning rate and initial scale (``--position-lr-scale``,
``--position-init-scale`` of ``hf-relpos train`` and ``lengthgen``; parameter groups for any optimizer)."""

import math

import pytest
import torch

import hf_relpos.commands.lengthgen as lengthgen_command
import hf_relpos_cli
from hf_relpos import RelPosForCausalLM
from hf_relpos import position_lr
from hf_relpos.position_lr import (
    position_lr_trainer,
    position_parameter_groups,
    position_parameter_names,
    scale_position_init,
)
from tiny import build, rand_ids

EXPECTED = {  # each scheme's position parameters, by name
    "t5_bias": ["model.position.relative_attention_bias.weight"],
    "rope": [],
    "alibi": [],
    "learned": ["model.position.position_embeddings.weight"],
    "shaw": [f"model.layers.{i}.self_attn.relative.{n}" for i in range(2) for n in ("rel_k", "rel_v")],
}


@pytest.mark.parametrize("scheme", list(EXPECTED))
def test_the_position_parameters_are_the_schemes_own(scheme):
    model = build(scheme)
    names = position_parameter_names(model)
    if scheme == "shaw":  # whatever Shaw's module calls its tables: exactly those of each layer's `relative`
        expected = [n for n, _ in model.named_parameters() if ".self_attn.relative." in n]
        assert expected and len(expected) == len(names)
    else:
        expected = EXPECTED[scheme]
    assert names == expected
    per_layer = build("t5_bias", relative_attention_per_layer=True)
    assert position_parameter_names(per_layer) == [f"model.position.layers.{i}.relative_attention_bias.weight"
                                                   for i in range(2)]


def test_parameter_groups_give_each_parameter_once_at_its_rate():
    model = build("t5_bias")
    groups = position_parameter_groups(model, lr=1e-3, position_lr_scale=0.03, weight_decay=0.01)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(3e-5)]
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert sorted(by_id[id(p)] for g in groups for p in g["params"]) == sorted(by_id.values())
    assert [by_id[id(p)] for p in groups[1]["params"]] == ["model.position.relative_attention_bias.weight"]


@pytest.mark.parametrize("scale", [0.03, 1.0])
def test_a_trainers_own_optimizer_runs_the_position_parameters_at_the_scale(scale, tmp_path):
    """Trainer's optimizer (its weight-decay groups kept) with the position parameters at scale x lr, and its
    cosine schedule keeping that ratio at every step."""
    from transformers import Trainer, TrainingArguments

    model = build("t5_bias").train()
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=2e-3, weight_decay=0.01, max_steps=10,
                             lr_scheduler_type="cosine", warmup_steps=2, report_to=[], use_cpu=True)
    plain = Trainer(model=model, args=args).create_optimizer()
    decay = {id(p): g["weight_decay"] for g in plain.param_groups for p in g["params"]}
    trainer = position_lr_trainer(Trainer, scale)(model=model, args=args)
    optimizer = trainer.create_optimizer()
    assert trainer.create_optimizer() is optimizer  # created once
    position = {id(p) for n, p in model.named_parameters() if n in position_parameter_names(model)}
    rates = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert id(p) not in rates
            rates[id(p)] = group["lr"]
            assert group["weight_decay"] == decay[id(p)]  # Trainer's decay rule, unchanged
    assert set(rates) == {id(p) for p in model.parameters()}
    for pid, lr in rates.items():
        assert lr == pytest.approx(2e-3 * (scale if pid in position else 1.0))
    scheduler = trainer.create_scheduler(num_training_steps=10, optimizer=optimizer)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
        lrs = {pid: g["lr"] for g in optimizer.param_groups for pid in map(id, g["params"])}
        ratio = [lrs[p] / lrs[q] for p in position for q in set(lrs) - position]
        assert all(math.isclose(r, scale, rel_tol=1e-9) for r in ratio)


def test_the_init_scale_multiplies_the_position_parameters_only():
    torch.manual_seed(0)
    before = RelPosForCausalLM(build("t5_bias").config)
    after = RelPosForCausalLM(before.config)
    after.load_state_dict(before.state_dict())
    scale_position_init(after, 0.03)
    position = set(position_parameter_names(after))
    for name, param in after.named_parameters():
        expected = before.get_parameter(name) * (0.03 if name in position else 1.0)
        assert torch.equal(param, expected), name


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True])
def test_a_scale_that_is_not_a_positive_number_is_one_line(value):
    with pytest.raises(ValueError, match=r"^position_lr_scale must be a finite number > 0, got "):
        position_lr_trainer(object, value)
    with pytest.raises(ValueError, match=r"^position_init_scale must be a finite number > 0, got "):
        scale_position_init(build("alibi"), value)


@pytest.mark.parametrize("command", ["train", "lengthgen"])
def test_both_commands_offer_the_options(command, capsys):
    with pytest.raises(SystemExit):
        hf_relpos_cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--position-lr-scale" in text and "--position-init-scale" in text
    with pytest.raises(SystemExit) as exit:
        hf_relpos_cli.main([command, "--position-lr-scale", "0"])
    assert exit.value.code == 2 and "--position-lr-scale: must be > 0.0, got 0" in capsys.readouterr().err


def test_a_lengthgen_run_trains_at_the_scale_and_records_it(monkeypatch):
    """run_one builds its Trainer through position_lr_trainer with the run's scale, starts the model scaled, and
    the record's settings name both (so that a resume never mixes setups)."""
    from test_lengthgen import SETTINGS

    seen = []
    real_trainer, real_init = position_lr.position_lr_trainer, position_lr.scale_position_init
    monkeypatch.setattr(position_lr, "position_lr_trainer", lambda base, scale: seen.append(("lr", scale)) or
                        real_trainer(base, scale))
    monkeypatch.setattr(position_lr, "scale_position_init", lambda model, scale: seen.append(("init", scale)) or
                        real_init(model, scale))
    settings = dict(SETTINGS, position_lr_scale=0.5, position_init_scale=0.25)
    record = lengthgen_command.run_one("copy", "t5_bias", 0, 3e-3, settings)
    assert sorted(seen) == [("init", 0.25), ("lr", 0.5)]
    assert record["settings"]["position_lr_scale"] == 0.5 and record["settings"]["position_init_scale"] == 0.25


def test_resuming_a_checkpoint_from_before_the_options_reads_them_as_one(tmp_path):
    """A checkpoint recorded before --position-lr-scale existed was trained at 1.0: resuming it with another scale is
    the usual one-line refusal (it was a traceback from the optimizer's state: another number of groups)."""
    import dataclasses
    import json

    from hf_relpos.commands import train
    from hf_relpos.commands.common import TIME_FILE
    from hf_relpos.commands.errors import UserError
    from hf_relpos.commands.options import TrainOptions

    options = TrainOptions()
    saved = train._run_options(options)
    for name in ("position_lr_scale", "position_init_scale"):
        del saved[name]
    (tmp_path / TIME_FILE).write_text(json.dumps({"options": saved}))
    train._check_resume_options(tmp_path, train._run_options(options))  # the defaults: the same run
    for name in ("position_lr_scale", "position_init_scale"):
        flag = "--" + name.replace("_", "-")
        with pytest.raises(UserError, match=rf"was trained with {flag} 1.0, this command gives {flag} 0.1;"):
            train._check_resume_options(tmp_path, train._run_options(dataclasses.replace(options, **{name: 0.1})))


def test_an_optimizer_without_the_models_own_parameters_is_refused():
    """A wrapper that flattens parameters (FSDP1 without use_orig_params) hands Trainer none of the model's own
    tensors: the split would silently change nothing, so it is refused."""
    model = build("t5_bias")
    flat = torch.nn.Parameter(torch.zeros(10))
    optimizer = torch.optim.AdamW([flat], lr=1e-3)
    with pytest.raises(ValueError, match=r"^position_lr_scale: the optimizer holds none of the model's position"):
        position_lr.split_position_groups(optimizer, model, 0.1)
    plain = torch.optim.AdamW(build("rope").parameters(), lr=1e-3)
    position_lr.split_position_groups(plain, build("rope"), 0.1)  # no position parameter: nothing to split
