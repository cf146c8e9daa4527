"""The `meshtrain` command line.

    meshtrain fit --config configs/tiny.yaml [--train.steps 20 --parallel.tp 2 ...]
    meshtrain fit --config configs/tiny.yaml --print_config
    meshtrain preprocess --input docs.jsonl --output_prefix data/docs --tokenizer bytes --append_eod
    meshtrain plan --config configs/llama3-405b.yaml --world 16384 --gpu h100 --json plan.json
    meshtrain plan --config configs/llama3-8b.yaml --world 64 --hardware my-cluster.yaml
    meshtrain calibrate --out this-machine.yaml [--nproc 2] [--quick]
    meshtrain export --checkpoint runs/tiny --out runs/tiny/hf [--dtype bf16|fp16|fp32]
    meshtrain generate --checkpoint runs/tiny --prompt "Four score" --max_new_tokens 40 --temperature 0
    meshtrain plot runs/tiny [runs/other ...] --out tiny.png

Every key of the YAML file can be overridden with a dotted flag. Bad input (a config
value, a dataset, a checkpoint) is printed as one line without a traceback and exits with
status 2, as argument errors do. A run stopped by its own safeguards (non-finite losses)
prints one line and exits 1. A rank that fails in a self-launched run is reported with its
own traceback, first, and the command exits 1 (3 for a rank the watchdog found stalled,
when it runs under torchrun). SIGINT / SIGTERM end a run after a step with a checkpoint
and exit 0; a second one ends it at once with exit 130 / 143. Options spelled with
underscores also take dashes (--output-prefix).
"""

from __future__ import annotations

import sys

from .cli_errors import explain
from .errors import ConfigError, TrainingError

EXIT_CONFIG = 2


# Errors come back to main() to be printed as one line (not usage + message), and a
# prefix of a key is an unknown key, not an abbreviation of it.
_STRICT = dict(exit_on_error=False, allow_abbrev=False)


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    from .config import RunConfig
    from .estimate.hardware_builtins import BUILTINS

    # A class_path in a config value must not import anything (a module's import runs its
    # code): the only classes a config may name are model.moe's, model.mla's and model.mtp's
    # dataclasses, which are ours, by the shortest import path that jsonargparse finds.
    set_parsing_settings(docstring_parse_attribute_docstrings=True, import_path_denylist=["*"],
                         import_path_allowlist=[f"meshtrain.models.{m}.{c}Config" for m, c in
                                                (("moe", "Moe"), ("mla", "Mla"), ("mtp", "Mtp"))])
    parser = ArgumentParser(**_STRICT, prog="meshtrain", description="Megatron-class LLM pre-training in PyTorch.")
    fit = ArgumentParser(**_STRICT, description="Train a model. Values come from the defaults, then --config files, "
                                     "then dotted flags, in the order given.")
    fit.add_argument("--config", action=ActionConfigFile, help="A YAML file with the keys below.")
    fit.add_class_arguments(RunConfig, as_group=False)
    plan = ArgumentParser(**_STRICT,
                          description="Dry-run a layout at any scale: mesh and nodes, sharding table, per-rank "
                                      "memory and collectives per step, from the config alone (no GPU, no "
                                      "process group).")
    plan.add_argument("--config", action=ActionConfigFile, help="A YAML file with the keys below.")
    plan.add_argument("--world", type=int, default=None,
                      help="Ranks to plan for (default: the smallest of the worlds the config's first line names, "
                           "'# ...: worlds 8, 64', as the GPU presets do; else the smallest whole number of nodes "
                           "the fixed parallel.* sizes fit).")
    plan.add_argument("--gpu", default=None, choices=list(BUILTINS),
                      help="Check the peak memory against this built-in device's capacity and model the step's "
                           "time on it (default for the time: h100).")
    plan.add_argument("--hardware", default=None,
                      help="A hardware file (meshtrain calibrate writes one; docs/plan.md): the device to check "
                           "memory against and model the step's time on, as --gpu does.")
    plan.add_argument("--search", action="store_true",
                      help="Also rank the layouts that fit the device (mesh, pp schedule, checkpointing, "
                           "micro-batch, kept weights) by modelled tokens/s per GPU and print the ten fastest "
                           "as flags to add.")
    plan.add_argument("--json", default=None, help="Also write the plan as JSON to this file.")
    plan.add_class_arguments(RunConfig, as_group=False)
    preprocess = ArgumentParser(**_STRICT, description="Tokenize a JSON-lines file into a Megatron-LM indexed dataset "
                                            "(<prefix>.bin and <prefix>.idx).")
    preprocess.add_argument("--input", required=True, help="A .jsonl file: one JSON object per line.")
    preprocess.add_argument("--output_prefix", "--output-prefix",
                            required=True, help="Path of the output without .bin/.idx.")
    preprocess.add_argument("--tokenizer", default="bytes", help="bytes, or the path of a tokenizer.json.")
    preprocess.add_argument("--append_eod", "--append-eod", action="store_true", help="End every document with EOS.")
    preprocess.add_argument("--workers", type=int, default=1, help="Processes that tokenize in parallel.")
    preprocess.add_argument("--text_key", "--text-key",
                            default="text", help="The JSON key holding each document's text.")
    preprocess.add_argument("--loss_mask_key", "--loss-mask-key", default=None,
                            help="The JSON key holding each document's training spans, [[start, end], ...] in "
                                 "characters of the text: only tokens that overlap them are trained on "
                                 "(<prefix>.loss_mask.bin).")
    export = ArgumentParser(**_STRICT, description="Write a checkpoint as a Hugging Face model directory: safetensors "
                                        "(sharded with an index above --max_shard_gb), config.json, "
                                        "generation_config.json and the run's tokenizer files. Streams one "
                                        "tensor at a time.")
    export.add_argument("--checkpoint", required=True,
                        help="A checkpoint directory (<run_dir>/checkpoints/step_N) or a run directory (its latest).")
    export.add_argument("--out", required=True, help="The output directory (must not exist or be empty).")
    export.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                        help="Weight dtype of the export (default: the run's, as checkpoint.export writes: fp32 "
                             "for train.precision fp32, fp16 for fp16, else bf16).")
    export.add_argument("--max_shard_gb", "--max-shard-gb",
                        type=float, default=2.0, help="Split the weights into files this large.")
    generate = ArgumentParser(**_STRICT, description="Continue a prompt with a trained model (one process, KV cache).")
    generate.add_argument("--checkpoint", required=True,
                          help="A checkpoint directory, a run directory (its latest), or a Hugging Face model directory.")
    generate.add_argument("--prompt", default=None, help="Text, encoded with the run's tokenizer.")
    generate.add_argument("--prompt_ids", "--prompt-ids",
                          default=None, help="Token ids instead of --prompt, e.g. 1,2,3.")
    generate.add_argument("--max_new_tokens", "--max-new-tokens",
                          type=int, default=32, help="Tokens to generate at most.")
    generate.add_argument("--temperature", type=float, default=1.0, help="0: greedy.")
    generate.add_argument("--top_k", "--top-k", type=int, default=None, help="Sample among the k most likely tokens.")
    generate.add_argument("--top_p", "--top-p", type=float, default=None, help="Sample within this probability mass.")
    generate.add_argument("--seed", type=int, default=0, help="Seed of the sampler.")
    generate.add_argument("--output_format", "--output-format", default="text", choices=["text", "json"],
                          help="json: one object per line with prompt_ids, generated_ids and text.")
    generate.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available).")
    plot = ArgumentParser(**_STRICT, description="Draw runs' metrics.jsonl overlaid into one image: loss (and eval "
                                      "loss), learning rate, grad norm and tokens/s by step. Needs matplotlib "
                                      "(pip install \"meshtrain[plot]\").")
    plot.add_argument("run_dirs", nargs="+", help="Run directories (each with its metrics.jsonl).")
    plot.add_argument("--out", required=True, help="The image to write (.png; .svg and .pdf work too).")
    calibrate = ArgumentParser(**_STRICT, description="Measure this machine (matmuls, attention, memory bandwidth, "
                                           "the local backend's collectives among --nproc ranks) and write a "
                                           "hardware file for meshtrain plan --hardware.")
    calibrate.add_argument("--out", required=True, help="The hardware YAML file to write.")
    calibrate.add_argument("--nproc", type=int, default=2, help="Ranks a run puts on this machine: they compute at once while "
                           "measured (CPU ranks share the cores); collectives among max(nproc, 2).")
    calibrate.add_argument("--quick", action="store_true", help="Few shapes and sizes, few repeats: seconds, rough.")
    subcommands = parser.add_subcommands(dest="command")
    subcommands.add_subcommand("fit", fit, help="Train a model (one process, self-launched ranks, or under torchrun).")
    subcommands.add_subcommand("plan", plan, help="Dry-run a layout: sharding, memory and collectives per rank.")
    subcommands.add_subcommand("calibrate", calibrate, help="Measure this machine and write a hardware file.")
    subcommands.add_subcommand("preprocess", preprocess, help="Tokenize text into a Megatron-LM indexed dataset.")
    subcommands.add_subcommand("export", export, help="Export a checkpoint to Hugging Face safetensors.")
    subcommands.add_subcommand("generate", generate, help="Generate text from a checkpoint or a Hugging Face model.")
    subcommands.add_subcommand("plot", plot, help="Plot runs' loss, learning rate, grad norm and tokens/s.")
    return parser


def _run_config(namespace, given=None):
    """The RunConfig of a parsed fit or plan command. With model.init_from, the model.*
    keys the command does not give come from its config.json (config/init_from.py);
    `given()` lists those it gives."""
    from .config import RunConfig

    values = namespace.as_dict()
    for key in ("config", "__path__", "__default_config__"):
        values.pop(key, None)
    cfg = RunConfig.from_dict(values)
    if cfg.model.init_from and given is not None:
        from .config.init_from import fill_from_init

        cfg = fill_from_init(cfg, given())
    return cfg


def _given(parser, argv: list[str], command: str):
    """A function listing the dotted keys the --config files and flags of `argv` give:
    jsonargparse parses them again without defaults, which keeps exactly what a file or a
    flag set (ActionConfigFile, several files, dotted flags, `model.moe: null`)."""
    def given() -> set[str]:
        from .config.init_from import given_keys

        return given_keys(getattr(parser.parse_args(_quote_slices(argv), defaults=False), command).as_dict())
    return given


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from argparse import ArgumentError

    try:  # these import torch: seconds in which a Ctrl-C is the user's to give
        from .data.errors import DataError
        from .run.launch import RankFailed
        from .run.stopping import Interrupted
        from .checkpoint import CheckpointError
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\nEvery key")[0])
        print("\nmeshtrain <command> --help lists a command's options; meshtrain --version its version.")
        return 0
    if argv[0] == "--version":
        print(_version())
        return 0
    parser = None
    try:
        _check_config_files(argv)
        parser = build_parser()
        args = parser.parse_args(_quote_slices(argv))
        if args.command == "fit":
            from .run.fit import fit

            fit(_run_config(args.fit, _given(parser, argv, "fit")))
        elif args.command == "plan":
            _plan(args.plan, _given(parser, argv, "plan"))
        elif args.command == "calibrate":
            from .run.calibrate import calibrate

            print(calibrate(args.calibrate.out, nproc=args.calibrate.nproc, quick=args.calibrate.quick))
        elif args.command == "preprocess":
            _preprocess(args.preprocess)
        elif args.command == "export":
            _export(args.export)
        elif args.command == "generate":
            from .generate import main_generate

            a = args.generate
            main_generate(a.checkpoint, prompt=a.prompt, prompt_ids=a.prompt_ids, max_new_tokens=a.max_new_tokens,
                          temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                          output_format=a.output_format, device=a.device)
        elif args.command == "plot":
            from .plot import plot_runs

            print(plot_runs(args.plot.run_dirs, args.plot.out))
        return 0
    except ConfigError as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except ArgumentError as e:
        print(f"meshtrain: config error: {explain(e, argv, parser)}", file=sys.stderr)
        return EXIT_CONFIG
    except DataError as e:
        print(f"meshtrain: data error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as e:
        print(f"meshtrain: checkpoint error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except TrainingError as e:
        print(f"meshtrain: training stopped: {e}", file=sys.stderr)
        return 1
    except RankFailed as e:
        print(f"meshtrain: {e}\n{e.report['traceback']}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"meshtrain: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside training (plan, export, preprocess, ...)
        print("meshtrain: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ours = version("meshtrain")
    except PackageNotFoundError:  # run from a checkout that was not installed
        ours = "(not installed)"
    return f"meshtrain {ours} (torch {torch.__version__}, Python {platform.python_version()})"


def _check_config_files(argv: list[str]) -> None:
    """Each --config file exists and is YAML, or one line that names the file, the line and
    the column (jsonargparse would say "<unicode string>")."""
    import yaml

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else \
            arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if path is None:
            continue
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"--config {path}: {e.strerror or e}") from None
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"--config {path}: not valid YAML{where}: {e.problem or e.context}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {e}") from None


def _quote_slices(argv: list[str]) -> list[str]:
    """`--model.moe.layers 1:` as the string it is: YAML, which reads every flag's value,
    takes `1:` for a mapping. A value the user quoted already is unquoted first."""
    import json
    import re

    key, out = "--model.moe.layers", list(argv)
    for i, arg in enumerate(out):
        at = i + 1 if arg == key else i if arg.startswith(key + "=") else None
        if at is None or at >= len(out):
            continue
        head, value = (key + "=", out[at][len(key) + 1:]) if at == i else ("", out[at])
        bare = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
        if re.fullmatch(r"-?\d*:-?\d*(:-?\d*)?", bare):
            out[at] = head + json.dumps(bare)
    return out


def _plan(a, given=None) -> None:
    import json
    import os
    import time

    from rich.console import Console

    from .estimate.dryrun import dry_run
    from .estimate.hardware import Hardware

    start = time.perf_counter()
    values = a.clone()
    for key in ("world", "gpu", "hardware", "json", "search"):
        delattr(values, key)
    if a.gpu and a.hardware:
        raise ConfigError(f"--gpu {a.gpu} and --hardware {a.hardware}: give one (a built-in device or a file)")
    device = Hardware.load(a.hardware) if a.hardware else a.gpu
    world = a.world if a.world is not None else _preset_world(a.config or [])
    run = dry_run(_run_config(values, given).validate(), world, device, search=a.search)
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:  # files and pipes: long lines stay whole
        console = Console(highlight=False, width=160)
    for renderable in run.renderables():
        console.print(renderable)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(run.to_dict(), f, indent=1)
    console.print(f"planned in {time.perf_counter() - start:.1f} s" + (f"; JSON in {a.json}" if a.json else ""))
    run.check()  # a layout over the GPU's memory: exit 2 after showing why


def _preset_world(configs) -> int | None:
    """The smallest world that the last of the --config files naming its worlds names
    (None: none does; dry_run then takes the smallest the layout allows)."""
    from .config.worlds import preset_worlds

    for path in reversed(configs):
        if worlds := preset_worlds(str(path)):
            return min(worlds)
    return None


def _export(a) -> None:
    from .run.export import export_checkpoint

    if not a.max_shard_gb > 0:
        raise ConfigError(f"--max_shard_gb={a.max_shard_gb}: give a positive size in GB")
    summary = export_checkpoint(a.checkpoint, a.out, dtype=a.dtype, max_shard_bytes=int(a.max_shard_gb * 2**30))
    print(f"exported step {summary['step']} of {summary['checkpoint']} to {a.out} ({summary['dtype']}, "
          f"{len(summary['files'])} file(s), {summary['total_bytes'] / 2**20:,.1f} MiB)")


def _preprocess(a) -> None:
    from .data.preprocess import preprocess

    stats = preprocess(a.input, a.output_prefix, tokenizer=a.tokenizer, append_eod=a.append_eod,
                       workers=a.workers, text_key=a.text_key, loss_mask_key=a.loss_mask_key)
    mask = f", the loss mask to {stats['loss_mask']}" if stats["loss_mask"] else ""
    docs = stats["documents"]
    print(f"wrote {docs:,} document{'s' * (docs != 1)}, {stats['tokens']:,} tokens ({stats['dtype']}) to "
          f"{a.output_prefix}.bin and {a.output_prefix}.idx, the tokenizer's record to {stats['record']}{mask}")


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
