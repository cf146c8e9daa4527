"""Hostile inputs (issue 10 item 7): configs build no classes and run no YAML tags, no file
a checkpoint or a model directory holds can run code when loaded, and index files cannot
make the loader read outside the model directory. Every attack would leave a file behind
(a log file, a directory) if it worked; each test asserts that it did not."""

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.cli import main
from meshtrain.interop.pieces import INDEX_FILE
from meshtrain.checkpoint.reader import _MetadataUnpickler

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
# The smallest model tiny.yaml allows: the checkpoint below is a few hundred KB.
SMALL = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.n_kv_heads", "1",
         "--model.ffn_dim", "64", "--model.vocab_size", "258", "--train.seq_len", "16", "--train.global_batch", "2",
         "--train.micro_batch", "2", "--train.warmup_steps", "0", "--data.valid_fraction", "0"]


def cli(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in this process."""
    try:
        code = main(list(args))
    except SystemExit as e:  # jsonargparse rejects a value as argparse does: usage, then exit 2
        code = e.code
    return code, capsys.readouterr().err


def fit_args(tmp_path: Path, *extra) -> list[str]:
    return ["fit", "--config", TINY, *SMALL, "--train.steps", "1", "--run_dir", str(tmp_path / "run"), *extra]


# --- configs: no class instantiation, no YAML tags --------------------------------------


def file_handler(trace: Path) -> dict:
    """A subclass spec whose construction creates `trace` (FileHandler opens its file)."""
    return {"class_path": "logging.FileHandler", "init_args": {"filename": str(trace)}}


# jsonargparse warns (a DeprecationWarning) that logging.FileHandler is on its import
# denylist, which it enforces only from v5 or once cli.py sets an import policy.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("key", ["data.paths", "model.rope_scaling", "model.moe"])
def test_flag_values_build_no_classes(capsys, tmp_path, key):
    trace = tmp_path / "pwned"
    code, err = cli(capsys, *fit_args(tmp_path, f"--{key}", json.dumps(file_handler(trace))))
    assert code == 2 and key in err, err
    assert not trace.exists()


@pytest.mark.parametrize("section", [
    lambda spec: {"data": {"paths": [[1.0, spec], [1.0, "builtin"]]}},
    lambda spec: {"model": {"moe": {"num_experts": 4, "top_k": 2, "router": spec}}},
    lambda spec: {"model": {"rope_scaling": {"factor": spec, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}}},
], ids=["data.paths-list", "model.moe.router", "model.rope_scaling.factor"])
def test_config_files_build_no_classes(capsys, tmp_path, section):
    trace = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(json.dumps(section(file_handler(trace))))  # JSON is YAML
    code, err = cli(capsys, *fit_args(tmp_path, "--config", str(config)))
    assert code == 2, err
    assert not trace.exists()


@pytest.mark.parametrize("key", ["data.paths", "model.moe"])
def test_class_paths_import_no_module(capsys, tmp_path, monkeypatch, key):
    trace = tmp_path / "imported"
    name = f"meshtrain_security_probe_{key.replace('.', '_')}"
    (tmp_path / f"{name}.py").write_text(f"open({str(trace)!r}, 'w').close()\nclass X:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code, err = cli(capsys, *fit_args(tmp_path, f"--{key}", json.dumps({"class_path": f"{name}.X"})))
    finally:
        sys.modules.pop(name, None)
    assert code == 2, err
    assert not trace.exists()


@pytest.mark.parametrize("yaml_text", [
    "run_dir: !!python/object/apply:os.system [\"touch {trace}\"]\n",
    "model:\n  moe: !!python/object/new:logging.FileHandler [\"{trace}\"]\n",
], ids=["apply-top-level", "new-object-nested"])
def test_yaml_tags_do_not_run(capsys, tmp_path, yaml_text):
    trace = tmp_path / "pwned2"
    config = tmp_path / "evil.yaml"
    config.write_text(yaml_text.format(trace=trace))
    code, err = cli(capsys, *fit_args(tmp_path, "--config", str(config)))
    assert code == 2, err
    assert "could not determine a constructor for the tag" in err and "python/object" in err, err
    assert not trace.exists()


# --- checkpoints: no pickle runs code ----------------------------------------------------


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    """A real one-step checkpoint of the smallest model."""
    base = tmp_path_factory.mktemp("checkpoint")
    assert main(fit_args(base, "--checkpoint.every", "1")) == 0
    (step,) = (base / "run" / "checkpoints").glob("step_*")
    return step


class MakesDir:
    """Unpickling it calls os.mkdir(path): proof that code from the file ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def read_metadata(step: Path):
    with open(step / ".metadata", "rb") as f:
        return _MetadataUnpickler(f, step).load()


def load_both_ways(capsys, step: Path, tmp_path: Path) -> list[tuple[int, str]]:
    """(exit code, stderr) of exporting and of generating from the checkpoint."""
    return [cli(capsys, "export", "--checkpoint", str(step), "--out", str(tmp_path / "hf")),
            cli(capsys, "generate", "--checkpoint", str(step), "--prompt_ids", "1,2", "--max_new_tokens", "1",
                "--device", "cpu")]


@pytest.mark.parametrize("nested", [False, True], ids=["whole-file", "inside-real-metadata"])
def test_malicious_metadata_pickle_runs_nothing(capsys, tmp_path, step_dir, nested):
    step = shutil.copytree(step_dir, tmp_path / "step")
    trace = tmp_path / "pwned"
    payload = MakesDir(trace)
    if nested:
        metadata = read_metadata(step)
        metadata.planner_data["x"] = payload
        payload = metadata
    (step / ".metadata").write_bytes(pickle.dumps(payload))
    for code, err in load_both_ways(capsys, step, tmp_path):
        assert code == 2 and "Traceback" not in err, err
        assert f"checkpoint error: checkpoint {step}: .metadata refers to posix.mkdir, which is not DCP " \
               "metadata" in err, err
    assert not trace.exists() and not (tmp_path / "hf").exists()


def test_malicious_tensor_file_runs_nothing(capsys, tmp_path, step_dir):
    step = shutil.copytree(step_dir, tmp_path / "step")
    trace = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(MakesDir(trace), buf)  # a well-formed torch file whose pickle calls os.mkdir
    payload = buf.getvalue()
    (step / "__0_0.distcp").write_bytes(payload)
    metadata = read_metadata(step)
    for info in metadata.storage_data.values():  # every tensor reads the payload
        info.offset, info.length = 0, len(payload)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    for code, err in load_both_ways(capsys, step, tmp_path):
        assert code == 2 and "Traceback" not in err, err
        assert f"checkpoint error: checkpoint {step}: reading " in err and "UnpicklingError: Weights only load " \
               "failed" in err, err
    assert not trace.exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "dotdot"])
def test_metadata_cannot_point_outside_the_checkpoint(capsys, tmp_path, step_dir, absolute):
    step = shutil.copytree(step_dir, tmp_path / "step")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(step / "__0_0.distcp", outside / "w.distcp")  # valid tensors: reading them would succeed
    metadata = read_metadata(step)
    for info in metadata.storage_data.values():
        info.relative_path = str(outside / "w.distcp") if absolute else "../outside/w.distcp"
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    code, err = cli(capsys, "generate", "--checkpoint", str(step), "--prompt_ids", "1,2", "--max_new_tokens", "1",
                    "--device", "cpu")
    # Refused for the path itself, before any tensor is read (the file outside is valid, so
    # an exit 2 for another reason would not show the check at work).
    name = str(outside / "w.distcp") if absolute else "../outside/w.distcp"
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint {step}: DCP .metadata names the tensor file {name!r}, which is not a file of this " \
           "directory" in err, err


# --- model directories: index entries stay inside; export writes only --out -------------


@pytest.fixture(scope="module")
def hf_dir(step_dir, tmp_path_factory) -> Path:
    """The checkpoint exported in several shards, so that it has an index."""
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", "--checkpoint", str(step_dir), "--out", str(out), "--max_shard_gb", "1e-5"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 2
    return out


@pytest.fixture
def opened(monkeypatch) -> list[Path]:
    """Every file safetensors opens, resolved."""
    from meshtrain.interop import load as hf_load

    paths, real = [], hf_load.safe_open  # where meshtrain's one reader looks it up

    def spy(path, *args, **kwargs):
        paths.append(Path(path).resolve())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hf_load, "safe_open", spy)
    return paths


def generate(capsys, model: Path) -> tuple[int, str]:
    return cli(capsys, "generate", "--checkpoint", str(model), "--prompt_ids", "1,2", "--max_new_tokens", "1",
               "--device", "cpu")


def escape(tmp_path: Path, hf_dir: Path, how: str) -> tuple[Path, Path, list[str]]:
    """A copy of hf_dir whose first shard lives in tmp_path/outside (intact: were it
    read, loading would succeed), reached the way `how` says. Returns the copy, the
    outside file and the words the refusal must hold."""
    model = shutil.copytree(hf_dir, tmp_path / "model")
    (tmp_path / "outside").mkdir()
    index = model / INDEX_FILE
    content = json.loads(index.read_text())
    shard = sorted(set(content["weight_map"].values()))[0]
    outside = shutil.move(model / shard, tmp_path / "outside" / shard).resolve()
    entry = {"absolute": str(outside), "dotdot": f"../outside/{shard}"}.get(how, shard)
    content["weight_map"] = {k: entry if v == shard else v for k, v in content["weight_map"].items()}
    index.write_text(json.dumps(content))
    if how.startswith("symlink"):
        (model / shard).symlink_to(outside)
    if how == "symlink-no-index":
        index.unlink()
        return model, outside, [f"{model / shard} resolves to {outside}, outside the model directory"]
    words = {"absolute": "is an absolute path", "dotdot": "leaves the model directory (..)",
             "symlink": f"resolves to {outside}, outside the model directory"}[how]
    return model, outside, [f"{index}: weight_map entry {entry!r} (tensor ", words]


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "symlink-no-index"])
def test_weight_files_outside_the_model_directory_are_refused(capsys, tmp_path, hf_dir, opened, how):
    model, outside, words = escape(tmp_path, hf_dir, how)
    code, err = generate(capsys, model)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for word in (*words, f"weights are read only from inside {model}"):
        assert word in err, (word, err)
    assert outside not in opened


def test_init_from_refuses_an_index_entry_outside(capsys, tmp_path, hf_dir, opened):
    model, outside, words = escape(tmp_path, hf_dir, "absolute")
    code, err = cli(capsys, *fit_args(tmp_path, "--model.init_from", str(model)))
    assert code == 2 and all(word in err for word in words), err
    assert outside not in opened


def test_hub_cache_snapshots_linking_to_their_blobs_still_load(capsys, tmp_path, hf_dir):
    # The Hugging Face hub cache: snapshots/<revision>/<file> -> ../../blobs/<hash>.
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(hf_dir.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    code, err = generate(capsys, snapshot)
    assert code == 0, err


def test_export_writes_only_inside_out(capsys, tmp_path, step_dir):
    # meta.json names the run's tokenizer; a hostile one names some other file, which
    # must not be copied into the export (and perhaps published with it).
    step = shutil.copytree(step_dir, tmp_path / "step")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN=hunter2\n")
    meta = json.loads((step / "meta.json").read_text())
    meta["extra"]["config"]["data"]["tokenizer"] = str(secret)
    (step / "meta.json").write_text(json.dumps(meta))
    parent = tmp_path / "exports"
    parent.mkdir()
    with pytest.warns(UserWarning, match="is not a Hugging Face tokenizer.json"):
        code, err = cli(capsys, "export", "--checkpoint", str(step), "--out", str(parent / "hf"), "--max_shard_gb",
                        "1e-5")
    assert code == 0, err
    assert os.listdir(parent) == ["hf"]
    weight_map = json.loads((parent / "hf" / INDEX_FILE).read_text())["weight_map"]
    expected = {INDEX_FILE, "config.json", "generation_config.json", *weight_map.values()}
    assert set(os.listdir(parent / "hf")) == expected and len(expected) > 5  # no tokenizer.json
    assert all(b"hunter2" not in (parent / "hf" / n).read_bytes() for n in expected)
