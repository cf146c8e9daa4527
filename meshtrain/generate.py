"""`meshtrain generate`: text from a trained model, one process, one device.

    meshtrain generate --checkpoint runs/tiny --prompt "Once upon" --max_new_tokens 32
    meshtrain generate --checkpoint hf/Llama-3.2-1B --prompt_ids 128000,9906 --temperature 0

The source is a meshtrain checkpoint directory (step_XXXXXXXX), a run directory (its
newest complete checkpoint) or a Hugging Face directory (config.json + *.safetensors).
Decoding uses the model families' KV-cache path (`decode`): the prompt in one call, then
one token per call. Sampling: temperature (0: greedy), then top-k, then top-p, drawn with
a torch.Generator seeded by `seed`, so a seed reproduces its text on the same device.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .checkpoint import META, load, newest_under
from .config.schema import ModelConfig, RunConfig
from .data.errors import DataError
from .data.tokenizer import load_tokenizer
from .errors import ConfigError
from .interop.hf import load_hf_params, read_hf_config
from .models import FAMILIES
from .run.export import saved_run
from .train.step import TrainState

OUTPUT_FORMATS = ("text", "json")


# --------------------------------------------------------------------------- generation


def _family(arch: str):
    if arch not in FAMILIES:
        raise ConfigError(f"model arch {arch!r} is unknown: generation supports {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"--max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ConfigError(f"--top_k={top_k!r} must be an integer >= 1 (0 or unset: no top-k filtering)")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ConfigError(f"--top_p={top_p!r} must be in (0, 1] (1 or unset: no top-p filtering)")


def _eos_set(eos_id) -> frozenset[int]:
    if eos_id is None:
        return frozenset()
    if isinstance(eos_id, int):
        return frozenset((eos_id,))
    return frozenset(int(e) for e in eos_id)


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator) -> int:
    """One token id from `logits` (vocab,)."""
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        probs, order = torch.softmax(logits, -1).sort(descending=True)
        # Keep the most likely tokens until their mass reaches top_p (at least one).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(params: Mapping[str, torch.Tensor], arch: str, family_cfg, prompt_ids: list[int],
             max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, eos_id: int | Iterable[int] | None = None,
             device: torch.device | str | None = None) -> list[int]:
    """The new token ids that follow `prompt_ids` (the prompt is not repeated): at most
    `max_new_tokens`, ending early with (and including) an `eos_id` token.

    temperature 0 is greedy decoding (top_k, top_p and seed then play no part); otherwise
    logits / temperature, filtered to the `top_k` most likely tokens and then to the
    smallest set whose probability reaches `top_p`, are sampled with a generator seeded by
    `seed`. Parameters are used in their own dtype, moved to `device` (default: where
    tok_emb is)."""
    family = _family(arch)
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ConfigError("the prompt is empty: give at least one token (--prompt or --prompt_ids)")
    vocab = family_cfg.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary 0..{vocab - 1}: "
                          "give ids the model was trained with")
    total = len(prompt_ids) + max_new_tokens
    if total > family_cfg.max_seq_len:
        room = family_cfg.max_seq_len - len(prompt_ids)
        fix = f"lower --max_new_tokens to {room}" if room > 0 else "shorten the prompt"
        raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) plus --max_new_tokens={max_new_tokens} is "
                          f"{total} tokens, more than the model's max_seq_len={family_cfg.max_seq_len}: {fix}")
    if max_new_tokens == 0:
        return []
    device = torch.device(device) if device is not None else params["tok_emb"].device
    params = {n: t.detach().to(device) for n, t in params.items()}
    dtype = params["tok_emb"].dtype
    eos = _eos_set(eos_id)
    generator = torch.Generator(device=device).manual_seed(int(seed))
    cache = family.init_cache(family_cfg, 1, total, dtype=dtype, device=device)

    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    logits = family.decode(family_cfg, params, tokens, cache, 0, last_only=True)
    pos = len(prompt_ids)
    out: list[int] = []
    while True:
        token = _next_token(logits[0, -1], temperature, top_k, top_p, generator)
        out.append(token)
        if token in eos or len(out) == max_new_tokens:
            return out
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)
        logits = family.decode(family_cfg, params, tokens, cache, pos, last_only=True)
        pos += 1


# --------------------------------------------------------------------------- sources


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_for_generate(source: str | os.PathLike, device: torch.device | str = "cpu"):
    """(arch, family_cfg, params, tokenizer or None) from a meshtrain checkpoint step
    directory, a run directory (its newest complete checkpoint) or a Hugging Face directory
    (config.json + *.safetensors). Parameters come in the dtype they were saved in."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"--checkpoint {source}: no such file or directory; give a checkpoint step directory, "
                          "a run directory or a Hugging Face model directory")
    if not path.is_dir():
        raise ConfigError(f"--checkpoint {source} is a file; give a checkpoint step directory, a run directory "
                          "or a Hugging Face model directory (config.json + *.safetensors)")
    if (path / META).is_file():
        return _load_meshtrain(path, device)
    if _is_hf_dir(path):
        return _load_hf(path, device)
    found = newest_under(path)
    if found is None:
        raise ConfigError(f"--checkpoint {source} holds no complete meshtrain checkpoint (no step_XXXXXXXX "
                          "with meta.json under it or its checkpoints/) and is no Hugging Face directory "
                          "(config.json + *.safetensors): train with checkpoint.every > 0, or point at a "
                          "checkpoint")
    return _load_meshtrain(found, device)


def _load_meshtrain(step_path: Path, device):
    _, run = saved_run(step_path, "use a checkpoint written by meshtrain fit")
    arch, cfg = run.model.arch, run.family_config()
    specs = _family(arch).param_specs(cfg)
    params = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in specs.items()}
    # Parameters only: the optimizer state stays on disk. load() also restores the
    # training RNG state, which generation must not inherit.
    rng = torch.get_rng_state()
    try:
        load(step_path, TrainState(params, {}, 0))
    finally:
        torch.set_rng_state(rng)
    params = {n: t.to(device) for n, t in params.items()}
    return arch, cfg, params, _tokenizer_or_none(run.data.tokenizer, step_path)


def _load_hf(hf_dir: Path, device):
    fields = dict(read_hf_config(hf_dir))
    run = RunConfig(model=ModelConfig(**fields))
    arch, cfg = run.model.arch, run.family_config()
    params = load_hf_params(hf_dir, arch, cfg, device=device)
    tokenizer = _tokenizer_or_none(hf_dir, hf_dir) if (hf_dir / "tokenizer.json").is_file() else None
    return arch, cfg, params, tokenizer


def _tokenizer_or_none(spec, where: Path):
    try:
        return load_tokenizer(spec)
    except DataError as e:
        warnings.warn(f"{where}: no tokenizer ({e}); token ids only (--prompt_ids)", stacklevel=3)
        return None


def _hf_eos(hf_dir: Path):
    """eos_token_id of generation_config.json, else of config.json (an int, a list or None)."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((hf_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if value is not None:
            return value
    return None


# --------------------------------------------------------------------------- command line


def _parse_ids(prompt_ids) -> list[int]:
    if isinstance(prompt_ids, str):
        pieces = [p for p in re.split(r"[,\s]+", prompt_ids.strip()) if p]
        try:
            return [int(p) for p in pieces]
        except ValueError:
            raise ConfigError(f"--prompt_ids={prompt_ids!r} must be comma-separated integers, e.g. 1,2,3") from None
    return [int(t) for t in prompt_ids]


def main_generate(checkpoint: str, prompt: str | None = None, prompt_ids: str | list[int] | None = None,
                  max_new_tokens: int = 32, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int = 0, output_format: str = "text",
                  device: str | None = None) -> dict:
    """`meshtrain generate`: load `checkpoint`, continue the prompt and print the result to
    stdout. output_format text: the prompt and its continuation as text (token ids, comma
    separated, without a tokenizer); json: one JSON object on one line with prompt_ids,
    generated_ids, text (the continuation; null without a tokenizer), stop ("eos" or
    "length") and seed. Returns that object (not an exit code)."""
    if output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"--output_format={output_format!r}: choose {' or '.join(OUTPUT_FORMATS)}")
    if (prompt is None) == (prompt_ids is None):
        raise ConfigError("give exactly one of --prompt (text) and --prompt_ids (comma-separated token ids)")
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arch, cfg, params, tokenizer = load_for_generate(checkpoint, device)
    if prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"--prompt needs a tokenizer, and {checkpoint} has none (no tokenizer.json, or the "
                              "run's data.tokenizer cannot be read): give token ids with --prompt_ids 1,2,3")
        ids = tokenizer.encode(prompt)
    else:
        ids = _parse_ids(prompt_ids)
    path = Path(checkpoint)
    eos = _hf_eos(path) if _is_hf_dir(path) and not (path / "meta.json").is_file() else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_id
    new = generate(params, arch, cfg, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, eos_id=eos, device=device)
    record = {"prompt_ids": ids, "generated_ids": new,
              "text": tokenizer.decode(new) if tokenizer is not None else None,
              "stop": "eos" if new and new[-1] in _eos_set(eos) else "length", "seed": seed}
    if output_format == "json":
        print(json.dumps(record), flush=True)
    elif tokenizer is not None:
        print(tokenizer.decode(ids + new), flush=True)
    else:
        print(",".join(map(str, new)), flush=True)
    return record
