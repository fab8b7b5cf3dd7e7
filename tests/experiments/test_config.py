"""Tests for experiments/config.py: flags, hparams checks, run directories.

The command-line tests run ``python -m experiments.train`` in subprocesses
from a fresh working directory, as a user would, sharing the test run's JAX
compilation cache (conftest.py); the runs whose process is no part of what
a test checks run in this process, through `train.main`, which spares each
the seconds of importing JAX, Flax, Orbax and Grain.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments import averaging_flags
from experiments import catalog
from experiments import config as config_lib
from experiments import errors
from experiments.data import datasets
from experiments import hparams_registry
from experiments.rundir import pack
from experiments.rundir import records
from experiments.runs import run as run_lib
from experiments import second_stage
from experiments import train
from experiments.rundir import claim
from experiments.training import steps as train_steps
from test_train import REPO, read_records, run_here


def test_every_config_field_is_a_flag(tmp_path):
  weights = tmp_path / "w.npz"  # --pretrained and --init_params must exist.
  weights.touch()
  params = tmp_path / "p.npz"
  params.touch()
  flags = {"dataset": "PACS", "algorithm": "Fishr", "test_envs": [1, 2],
           "data_dir": "d", "output_dir": "o", "overwrite": True, "steps": 7,
           "checkpoint_freq": 3, "seed": 4, "hparams_seed": 5,
           "trial_seed": 6, "holdout_fraction": 0.3, "hparams": '{"ema": 0.9}',
           "model": "resnet18", "pretrained": str(weights),
           "init_params": str(params), "eval_examples": 8,
           "loss_examples": 9, "eval_batch_size": 10,
           "trajectory_freq": 11, "plateau_check_freq": 12, "devices": 1,
           "num_workers": 2, "compile_cache_dir": "c", "averaging": "swad",
           "swad_n_converge": 2, "swad_n_tolerance": 4,
           "swad_tolerance_ratio": 0.5, "ema_decay": None,
           "sma_start_iter": None, "lr_schedule_from": None,
           "lr_schedule": None}
  assert set(flags) == {f.name for f in dataclasses.fields(config_lib.Config)}
  # The one field that is no flag: what --lr_schedule_from resolves to
  # (test_loop_lr_schedule_from.py passes that flag).
  parsed = vars(config_lib.make_parser().parse_args([]))
  assert {f.name for f in dataclasses.fields(config_lib.Config)
          if f.name not in parsed} == {"lr_schedule"}
  argv = []
  for name, value in flags.items():
    if value is None:  # The knobs of another averaging: not passed.
      continue
    if value is True:
      argv.append(f"--{name}")
    else:
      argv += [f"--{name}", *map(str, value if isinstance(value, list)
                                 else [value])]
  assert dataclasses.asdict(config_lib.parse_args(argv)) == flags


def test_defaults_resolve_per_dataset_and_overrides_are_checked():
  config = config_lib.parse_args([]).resolve()
  assert (config.dataset, config.algorithm, config.test_envs) == (
      "RotatedDigits", "PGrad-B", [0])
  assert config.model == "mnist_cnn"
  facts = catalog.DATASETS["RotatedDigits"]
  assert (config.steps, config.checkpoint_freq) == (300, 50) == (
      facts.steps, facts.checkpoint_freq)
  assert config.hyperparameters()["batch_size"] == 63
  assert config_lib.parse_args(["--dataset", "PACS"]).resolve().model == (
      "resnet50")
  override = config_lib.Config(hparams='{"lr": 0.5}')
  assert override.hyperparameters()["lr"] == 0.5
  with pytest.raises(errors.UsageError, match="Unknown hparams"):
    config_lib.Config(hparams='{"meta_lr": 0.5}').hyperparameters()


@pytest.mark.parametrize("flags, pretrained", [
    # DomainBed's photo datasets, as DomainBed: its ResNet-50 from ImageNet.
    (["--dataset", "PACS"], "imagenet"),
    (["--dataset", "DomainNet", "--model", "resnet18"], "imagenet"),
    # WILDS's: FMoW's DenseNet-121 from ImageNet, PovertyMap from scratch.
    (["--dataset", "FMoW"], "imagenet"),
    (["--dataset", "PovertyMap-B"], None),
    # The digits, and a network without ImageNet weights, from scratch.
    ([], None), (["--dataset", "PACS", "--model", "mnist_cnn"], None),
    # --init_params sets every weight.
    (["--dataset", "PACS", "--init_params", "p.npz"], None),
    # "none" is kept where it is not the default, so that the run's
    # identity differs from the default's.
    (["--dataset", "PACS", "--pretrained", "none"], "none"),
    (["--pretrained", "none"], None),
])
def test_pretrained_defaults_follow_the_references(flags, pretrained,
                                                  tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "p.npz").touch()  # --init_params must exist.
  config = config_lib.parse_args(flags)
  assert config.pretrained == pretrained
  assert config.resolve().pretrained == pretrained  # Resolved once for all.


def test_pretrained_mistakes_are_refused_at_the_command_line(tmp_path,
                                                            capsys):
  params = tmp_path / "final_params.npz"  # A run's, as checkpoints.save_params.
  np.savez(params, **{"params/head/bias": np.zeros(3),
                      "stats/featurizer/bn1/mean": np.zeros(3)})
  for flags, message in [
      (["--pretrained", str(tmp_path / "nope.npz")],
       "no such file or directory. Pass imagenet"),
      # Every kind of file it reads is named, timm's included.
      (["--pretrained", str(tmp_path / "nope.npz")],
       "a .pth, .safetensors or .npz file or an Orbax directory"),
      (["--pretrained", str(params)], f"--init_params {params} instead"),
      (["--pretrained", "imagenet"], "no ImageNet weights of mnist_cnn"),
      (["--dataset", "PACS", "--model", "resnet18", "--pretrained",
        "imagenet_augmix"], "no AugMix weights of resnet18; there are of "
       "resnet50 (pass --model resnet50)"),
      (["--init_params", str(tmp_path / "nope.npz")],
       f"no such file; pass a run's {records.FINAL_PARAMS_FILE}"),
  ]:
    with pytest.raises(SystemExit) as exit_info:
      config_lib.parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize("flags, bn_mode", [
    (["--pretrained", "imagenet_augmix"], "train"),
    (["--pretrained", "imagenet_augmix", "--hparams", '{"bn_mode": "frozen"}'],
     "frozen"),
    ([], "frozen"), (["--pretrained", "imagenet"], "frozen"),
    # WILDS trains BatchNorm whatever the weights.
    (["--dataset", "FMoW", "--model", "resnet50"], "train"),
])
def test_augmix_weights_train_batchnorm_as_domainbed_does(flags, bn_mode):
  config = config_lib.parse_args(["--dataset", "PACS", *flags])
  assert config.hyperparameters()["bn_mode"] == bn_mode


@pytest.mark.parametrize("freq, message", [
    ("-100", ">= 0"), ("150", "multiple of --checkpoint_freq [(]100[)]")])
def test_plateau_check_freq_is_checked(freq, message):
  with pytest.raises(errors.UsageError, match=message):
    config_lib.Config(checkpoint_freq=100, plateau_check_freq=int(freq)
                      ).resolve()


def test_every_field_but_location_and_execution_names_the_run():
  config = config_lib.Config().resolve()
  fields = {f.name for f in dataclasses.fields(config)}
  # Without averaging, its fields are none of the run's.
  assert set(config.identity()) == fields.difference(
      config_lib.LOCATION_FIELDS, config_lib.EXECUTION_FIELDS,
      averaging_flags.FIELDS, second_stage.FIELDS)
  on = config_lib.Config(plateau_check_freq=100).resolve()
  assert on.identity() == {**config.identity(), "plateau_check_freq": 100}
  assert on.output_dir != config.output_dir
  # With it, the averaging and its own knobs, resolved, are.
  swad = config_lib.Config(averaging="swad").resolve()
  assert swad.identity() == {
      **config.identity(), "averaging": "swad", "swad_n_converge": 3,
      "swad_n_tolerance": 6, "swad_tolerance_ratio": 0.3}
  assert swad.output_dir != config.output_dir
  ema = config_lib.Config(averaging="ema", ema_decay=0.9).resolve()
  assert ema.identity() == {**config.identity(), "averaging": "ema",
                            "ema_decay": 0.9}


def test_the_committed_runs_keep_their_identities():
  # Every run of the study, configured by its recorded args, is the same
  # run: its identity is its config.json's args, as its records' are.
  packed = pack.read_pack(REPO / "results" / "study")
  assert len(packed) > 100
  for name, run in packed.items():
    args = run.config["args"]
    config = config_lib.Config(**args).resolve()
    assert config.identity() == args, name
    assert {k: v for k, v in run.records[-1]["args"].items()
            if k not in config_lib.LOCATION_FIELDS} == args, name


@pytest.mark.parametrize("flags, message", [
    (["--averaging", "swa"], "--averaging 'swa' is none of none, ema, sma, "
     "swad"),
    (["--ema_decay", "0.9"], "--ema_decay is a knob of --averaging ema, and "
     "this run's --averaging is none"),
    (["--averaging", "swad", "--sma_start_iter", "5"],
     "--sma_start_iter is a knob of --averaging sma"),
    (["--averaging", "ema", "--ema_decay", "1"], "--ema_decay must be in "
     r"\[0, 1\), got 1.0"),
    (["--averaging", "sma", "--sma_start_iter", "0"], "at least 1, got 0"),
    (["--averaging", "swad", "--swad_n_tolerance", "0"], "at least 1"),
    (["--averaging", "swad", "--swad_tolerance_ratio", "-1"],
     "tolerance_ratio must be finite and at least 0"),
    (["--algorithm", "ERMPlusPlus", "--averaging", "sma"],
     "ERMPlusPlus averages its weights itself"),
])
def test_averaging_flags_are_checked(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    config_lib.parse_flags(flags)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert re.search(message, err), err
  assert "Traceback" not in err


def test_an_sma_that_never_starts_is_warned_of(capsys):
  config, _ = config_lib.parse_flags(["--averaging", "sma", "--steps", "300"])
  assert config.sma_start_iter == 600
  assert ("Warning: --averaging sma starts at update 600 (--sma_start_iter), "
          "after this run's 300 steps: its average is the trained weights."
          in capsys.readouterr().err)
  config_lib.parse_flags(["--averaging", "sma", "--steps", "600"])
  assert "Warning" not in capsys.readouterr().err


# The default command made cheap: two steps, small batches in one chunk (a
# shorter rollout compiles faster), small evaluations.
SHORT = ["--steps", "2", "--checkpoint_freq", "2", "--eval_examples", "16",
         "--loss_examples", "8"]
TINY = [*SHORT, "--hparams", '{"batch_size": 3, "B": 1}']


def _train_in(cwd, *flags, python_flags=()):
  """Runs the train command in ``cwd``, as a user would from a checkout."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
  return subprocess.run([sys.executable, *python_flags, "-m",
                         "experiments.train", *flags],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        check=False)


def _printed_accuracy(result, domain, env_index):
  """The held-out accuracy the run printed for one domain."""
  assert result.returncode == 0, result.stderr
  last = result.stdout.strip().splitlines()[-1]
  label = f"{domain} (env{env_index}) "
  assert label in last, last
  return float(re.match(r"\d\.\d{4}", last.split(label)[1]).group())


def _final_record(output_dir):
  return read_records(output_dir)[-1]


def _only_run_dir(runs, pattern):
  (found,) = runs.glob(pattern)
  return found


@pytest.mark.slow
def test_commands_in_one_directory_never_print_an_old_result(
    tmp_path, monkeypatch, capsys):
  # The README's commands one after the other in one working directory: each
  # gets its own run directory and prints its own result. The three that
  # train run in this process (main, in that directory); the command that
  # prints a finished run's result again, and the refused one, in their own.
  monkeypatch.chdir(tmp_path)
  first = run_here(TINY, capsys)
  run0 = _only_run_dir(tmp_path / "runs", "RotatedDigits-PGrad-B-test0-*")
  assert _printed_accuracy(first, "0°", 0) == round(
      _final_record(run0)["env0_in_acc"], 4)

  second = run_here([*TINY, "--test_envs", "1"], capsys)
  assert "Resuming" not in second.stderr
  run1 = _only_run_dir(tmp_path / "runs", "RotatedDigits-PGrad-B-test1-*")
  record = _final_record(run1)
  assert record["args"]["test_envs"] == [1]
  assert _printed_accuracy(second, "15°", 1) == round(record["env1_in_acc"], 4)

  fish = run_here(["--dataset", "ColoredDigits", "--algorithm", "Fish",
                   "--test_envs", "2", *SHORT, "--hparams",
                   '{"batch_size": 3}'], capsys)
  assert "Resuming" not in fish.stderr
  run2 = _only_run_dir(tmp_path / "runs", "ColoredDigits-Fish-test2-*")
  record = _final_record(run2)
  assert (record["args"]["algorithm"], record["args"]["dataset"]) == (
      "Fish", "ColoredDigits")
  assert _printed_accuracy(fish, "-90%", 2) == round(record["env2_in_acc"], 4)
  assert len(list((tmp_path / "runs").iterdir())) == 3

  # The same command again finds its own finished run and prints its result.
  again = _train_in(tmp_path, *TINY, "--test_envs", "1")
  assert "Already finished." in again.stderr
  assert again.stdout == second.stdout

  # Another configuration in an existing run's directory is refused before
  # any work, naming the differing key and the ways out; nothing changes.
  before = {p: p.read_bytes() for p in run0.rglob("*") if p.is_file()}
  refused = _train_in(tmp_path, *TINY, "--test_envs", "1",
                      "--output_dir", str(run0))
  assert refused.returncode == 2
  assert "test_envs: [1] here, [0] there" in refused.stderr
  assert "--output_dir" in refused.stderr and "--overwrite" in refused.stderr
  assert "Traceback" not in refused.stderr and refused.stdout == ""
  assert {p: p.read_bytes() for p in run0.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("hparams, named", [
    ('{"lr": -0.001}', "'lr' must be a number > 0, got -0.001"),
    ('{"batch_size": 0}', "'batch_size' must be an integer >= 1, got 0"),
    ('{"k": 0}', "'k' must be an integer >= 1 or one of 'all', got 0"),
    ('{"k": 2.5}', "'k' must be an integer >= 1 or one of 'all', got 2.5"),
    ('{"batch_size": 64}', "'batch_size' must be a multiple of B = 3"),
    # The CNN's GroupNorm splits every width into 8 groups.
    ('{"cnn_width": 12}', "'cnn_width' must be a multiple of 8 >= 8, got 12"),
    ('{"cnn_width": 0}', "'cnn_width' must be a multiple of 8 >= 8, got 0"),
    ('{"lr": 1e-3', "--hparams is not valid JSON"),
    ('[1e-3]', "--hparams must be a JSON object"),
    ('{"meta_lr": 0.5}', "Unknown hparams ['meta_lr']"),
])
def test_bad_hparams_are_usage_errors_and_write_nothing(
    hparams, named, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    train.main(["--hparams", hparams])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert named in err and "--hparams" in err
  assert list(tmp_path.iterdir()) == []


def test_an_unknown_algorithm_is_a_usage_error(tmp_path):
  result = _train_in(tmp_path, "--algorithm", "Nope")
  assert result.returncode == 2
  assert "argument --algorithm: invalid choice: 'Nope'" in result.stderr
  assert "Traceback" not in result.stderr
  assert list(tmp_path.iterdir()) == []


# What makes a command line slow to refuse: each takes seconds to import.
HEAVY_MODULES = {"jax", "flax", "optax", "grain", "orbax", "pgrad_jax"}


@pytest.mark.parametrize("flags, status", [
    (["--algorithm", "Nope"], 2), (["--dataset", "Nope"], 2),
    (["--model", "Nope"], 2), (["--hparams", '{"lr": -1}'], 2),
    (["--help"], 0),
    (["--list_hparams", "--algorithm", "Fish", "--dataset", "PACS"], 0),
])
def test_the_command_line_is_checked_before_jax_is_imported(
    flags, status, tmp_path):
  # -X importtime writes a line per module imported, so an import of JAX,
  # however quick, shows.
  result = _train_in(tmp_path, *flags, python_flags=("-X", "importtime"))
  assert result.returncode == status, result.stderr[-2000:]
  imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
              for line in result.stderr.splitlines()
              if line.startswith("import time:")}
  assert "experiments" in imported
  assert not imported & HEAVY_MODULES, imported & HEAVY_MODULES
  assert "Traceback" not in result.stderr


# The photo datasets' names changed once, when their runs began to start
# from ImageNet weights by default (--pretrained imagenet): their earlier
# default runs trained from scratch.
@pytest.mark.parametrize("dataset, directory_hash", [
    ("RotatedDigits", "f7731b64"), ("ColoredMNIST5k", "54a0a700"),
    ("DomainNet", "5bac2907"), ("PACS", "e4fa66c3"),
    ("TerraIncognita", "32a5a32d"), ("PovertyMap-C", "2fa3a291"),
    ("FMoW", "a08acb3e")])
def test_default_output_dirs_keep_the_names_existing_sweeps_have(
    dataset, directory_hash):
  # The names of the resolved defaults (steps, checkpoint frequency, model)
  # since every field joined the identity: a change renames users' runs,
  # which then train again rather than resume.
  config = config_lib.parse_args(["--dataset", dataset])
  assert config.output_dir == str(
      config_lib.DEFAULT_RUNS_DIR
      / f"{dataset}-PGrad-B-test0-{directory_hash}")


def test_help_lists_the_registries_and_list_hparams_prints_them(capsys):
  with pytest.raises(SystemExit) as exit_info:
    config_lib.parse_args(["--help"])
  assert exit_info.value.code == 0
  text = " ".join(capsys.readouterr().out.split())
  for name in (*catalog.DATASETS, *catalog.ALGORITHMS, *catalog.MODELS):
    assert name in text
  assert "--list_hparams" in text

  with pytest.raises(SystemExit) as exit_info:
    config_lib.parse_args(["--list_hparams", "--algorithm", "Fishr",
                           "--dataset", "PACS"])
  assert exit_info.value.code == 0
  rows = {line.split()[0]: line.split(maxsplit=2)
          for line in capsys.readouterr().out.splitlines()[1:]}
  defaults = hparams_registry.default_hparams("Fishr", "PACS")
  assert rows.keys() == defaults.keys()
  for name, default in defaults.items():
    assert rows[name][1] == repr(default), name
  assert rows["lr"][2].startswith("10^U(-5, -3.5)")
  assert rows["ema"][2].endswith("a number in [0, 1)")
  assert rows["bn_mode"][2].startswith("fixed")


def test_default_output_dir_is_one_per_configuration():
  dirs = {config_lib.parse_args(flags).output_dir for flags in (
      [], ["--test_envs", "1"], ["--seed", "1"], ["--hparams", '{"k": 2}'],
      ["--steps", "5"])}
  assert len(dirs) == 5
  assert all(d.startswith(str(config_lib.DEFAULT_RUNS_DIR)) for d in dirs)
  # Where the data is and whether to overwrite are no part of the identity.
  assert (config_lib.parse_args(["--data_dir", "x", "--overwrite"]).output_dir
          == config_lib.parse_args([]).output_dir)
  # The sweep names its runs with the same hash.
  config = config_lib.parse_args([])
  assert config.output_dir.endswith(
      "RotatedDigits-PGrad-B-test0-"
      + run_lib.Run.create(config.identity(), "s").output_dir.name[:8])


def test_a_run_resolves_once_into_a_frozen_spec_that_training_reads(
    tmp_path, monkeypatch):
  resolved = []

  def counted(function):
    def call(*args, **kwargs):
      resolved.append(function.__name__)
      return function(*args, **kwargs)
    return call

  for owner, name in ((config_lib.Config, "resolve"),
                      (config_lib.Config, "hyperparameters"),
                      (config_lib.Config, "check_batch_split"),
                      (claim, "claim_run_directory"),
                      (datasets, "get_dataset"), (train, "wilds_protocol")):
    monkeypatch.setattr(owner, name, counted(getattr(owner, name)))
  run = tmp_path / "run"
  spec = train.resolve_run([*TINY, "--test_envs", "1", "--output_dir",
                            str(run)])
  assert sorted(resolved) == ["check_batch_split", "claim_run_directory",
                              "get_dataset", "hyperparameters", "resolve"]
  assert (spec.config.test_envs, spec.train_domains, spec.resume) == (
      [1], (0, 2, 3, 4, 5), False)
  # One configuration, which names the run: no WILDS protocol on the digits.
  assert spec.run_record["args"] == spec.config.identity()
  assert (spec.hparams["B"], spec.hparams["batch_size"]) == (1, 3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.config.steps = 3
  with pytest.raises(TypeError):
    spec.hparams["lr"] = 1.0
  with pytest.raises(TypeError):
    spec.run_record["args"] = {}
  assert not run.exists()
  # Training resolves nothing again: it reads the spec.
  resolved.clear()
  record = train.claim_and_train(spec)
  assert resolved == []
  assert record["hparams"] == dict(spec.hparams)
  assert record["args"] == spec.config.record_args()
  assert json.loads((run / records.CONFIG_FILE).read_text()) == (
      claim.run_record(spec.config.identity(), spec.hparams)) == (
          spec.run_record)


def test_a_run_failing_before_its_first_checkpoint_leaves_no_folders(
    tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert train.main(["--dataset", "ColoredDigits", "--test_envs", "3"]) == 2
  assert "--test_envs [3] out of range" in capsys.readouterr().err

  def failing_step(*args):
    raise RuntimeError("the step failed")

  monkeypatch.setattr(train_steps, "make_train_step", failing_step)
  with pytest.raises(RuntimeError, match="the step failed"):
    train.main(["--dataset", "ColoredDigits", "--algorithm", "ERM"])
  assert list(tmp_path.iterdir()) == []


def test_negative_trajectory_freq_is_rejected():
  with pytest.raises(ValueError, match="trajectory_freq"):
    config_lib.Config(trajectory_freq=-1).resolve()


@pytest.mark.parametrize("flags, message", [
    # The default PGrad-B batch, 63 per domain in 3 chunks: 12 must divide.
    (["--devices", "4"],
     "--devices 4: PGrad-B's batch of 63 examples per domain in B = 3 chunks "
     "does not split over 4 devices: it must be a multiple of 12 (B x "
     """devices). Pass --hparams '{"batch_size": 60}' or 72, or --devices 1 """
     "or 3."),
    (["--algorithm", "Fish", "--devices", "3", "--hparams",
      '{"batch_size": 8}'],
     "Fish's batch of 8 examples per domain does not split over 3 devices: "
     """it must be a multiple of 3. Pass --hparams '{"batch_size": 6}' or 9, """
     "or --devices 1 or 2."),
    (["--algorithm", "ERM", "--devices", "2"],
     "--devices 2: ERM's update pools or re-slices the domains' batches, "
     "which a data axis cannot split; train it with --devices 1."),
    (["--devices", "0"], "--devices must be a positive integer, got 0."),
])
def test_devices_that_cannot_split_the_batch_are_usage_errors(
    capsys, flags, message):
  with pytest.raises(SystemExit) as exited:
    config_lib.parse_args(flags)
  assert exited.value.code == 2
  assert message in capsys.readouterr().err


def test_devices_stay_out_of_the_identity_and_the_records():
  one, four = (config_lib.parse_args(["--devices", devices, "--hparams",
                                      '{"batch_size": 60}'])
               for devices in ("1", "4"))
  assert one.output_dir == four.output_dir
  assert one.identity() == four.identity()
  assert "devices" not in four.record_args()
  assert four.record_args() == one.record_args()


@pytest.mark.parametrize("inside", ["PACS/runs/erm", "PACS", "link/erm"])
def test_an_output_dir_inside_the_dataset_folder_is_refused(
    tmp_path, capsys, inside):
  # Its files would be an unexpected folder beside the domains, and every
  # later run on the data would stop on them. "link" is the data folder by
  # a symlink.
  data_dir = tmp_path / "data"
  (data_dir / "PACS").mkdir(parents=True)
  (tmp_path / "link").symlink_to(data_dir / "PACS")
  output_dir = (tmp_path if inside.startswith("link") else data_dir) / inside
  assert train.main(["--dataset", "PACS", "--data_dir", str(data_dir),
                     "--output_dir", str(output_dir), "--overwrite"]) == 2
  err = capsys.readouterr().err
  assert (f"error: --output_dir {output_dir} is inside PACS's folder "
          f"{data_dir / 'PACS'}, where its files would be read as the "
          "dataset's; pass an --output_dir outside it.") in err
  assert "Traceback" not in err
  assert sorted(p.name for p in (data_dir / "PACS").iterdir()) == []
