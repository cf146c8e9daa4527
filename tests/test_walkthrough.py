"""A user's first hour (issue 19): the README's main command, then every command of
docs/interop.md's Export and Generate sections and its Python snippet, exactly as the files
write them, in a fresh directory holding only configs/. One 100-step fit (about a minute on
two CPU cores) serves every check. References: Python's UTF-8 bytes and transformers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Four score and"

pytestmark = pytest.mark.slow


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.DOTALL)


def meshtrain_commands(path: Path) -> list[list[str]]:
    """Every `meshtrain ...` command line of the file's bash blocks, continuations joined and
    comments dropped, as argv lists."""
    commands = []
    for block in blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "meshtrain":
                commands.append(argv)
    return commands


def run(cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`meshtrain ...` as the console script would run it, from cwd. One intra-op thread, as
    test_cli's runs: on a small shared CPU box more threads only contend."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "meshtrain.cli", *argv[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1200)


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """The directory the commands ran in and {command line: its CompletedProcess}."""
    cwd = tmp_path_factory.mktemp("first_hour")
    shutil.copytree(ROOT / "configs", cwd / "configs")
    fit = [c for c in meshtrain_commands(ROOT / "README.md") if c[1] == "fit"]
    assert fit == [["meshtrain", "fit", "--config", "configs/tiny.yaml"]]  # the README's main command
    done = {}
    for argv in fit + meshtrain_commands(ROOT / "docs" / "interop.md"):
        done[shlex.join(argv)] = proc = run(cwd, argv)
        assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}"
    return cwd, done


def by_prefix(done: dict, prefix: str) -> list[subprocess.CompletedProcess]:
    return [proc for line, proc in done.items() if line.startswith(prefix)]


def safetensors_dtypes(path: Path) -> set[str]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return {v["dtype"] for k, v in json.loads(raw[8:8 + size]).items() if k != "__metadata__"}


def bytes_text(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_fit_leaves_checkpoints_to_export(walkthrough):
    cwd, _ = walkthrough
    assert sorted(p.name for p in (cwd / "runs" / "tiny" / "checkpoints").iterdir()) == \
        ["step_00000050", "step_00000100"]


def test_exports_default_to_the_run_precision_with_the_usual_modes(walkthrough):
    cwd, done = walkthrough
    assert len(by_prefix(done, "meshtrain export --checkpoint runs/tiny --out runs/tiny/hf")) == 1
    umask = os.umask(0)
    os.umask(umask)
    tiny = cwd / "runs" / "tiny"
    for out, dtype in ((tiny / "hf", "F32"), (tiny / "hf-bf16", "BF16")):  # fp32 run; --dtype bf16
        assert safetensors_dtypes(out / "model.safetensors") == {dtype}
        assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
        assert all(os.stat(out / n).st_mode & 0o777 == 0o666 & ~umask for n in names)


def test_generate_with_a_text_prompt_from_the_run_and_the_export(walkthrough):
    _, done = walkthrough
    from_run = by_prefix(done, f"meshtrain generate --checkpoint runs/tiny --prompt '{PROMPT}'")
    from_export = by_prefix(done, f"meshtrain generate --checkpoint runs/tiny/hf --prompt '{PROMPT}'")
    assert len(from_run) == 1 and len(from_export) == 1
    assert from_run[0].stdout.startswith(PROMPT)
    record = json.loads(from_export[0].stdout)
    assert record["prompt_ids"] == [256, *PROMPT.encode()]
    assert record["text"] == bytes_text(record["generated_ids"]) and record["text"]
    by_ids = by_prefix(done, "meshtrain generate --checkpoint runs/tiny/hf --prompt_ids 256,70,111")
    assert len(by_ids) == 1 and by_ids[0].stdout.startswith("Fo")


def test_transformers_reads_the_export_as_the_docs_say(walkthrough, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cwd, done = walkthrough
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained("runs/tiny/hf")
    for text in (PROMPT, "", " two  spaces\n", "naïve 日本 🙂", "<bos>"):
        assert tok(text)["input_ids"] == [256, *text.encode()], text
    (snippet,) = blocks(ROOT / "docs" / "interop.md", "python")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet, {})
    # transformers' greedy continuation, decoded by its tokenizer, is meshtrain's.
    (greedy,) = by_prefix(done, f"meshtrain generate --checkpoint runs/tiny --prompt '{PROMPT}'")
    assert printed.getvalue() == greedy.stdout
