"""The `meshtrain` command line.

    meshtrain fit --config configs/tiny.yaml [--train.steps 20 --parallel.tp 2 ...]
    meshtrain fit --config configs/tiny.yaml --print_config
    meshtrain preprocess --input docs.jsonl --output-prefix data/docs --tokenizer bytes --append-eod
    meshtrain plan --config configs/llama3-405b.yaml --world 16384 --gpu h100 --json plan.json
    meshtrain export --checkpoint runs/tiny --out runs/tiny/hf [--dtype bf16|fp32]
    meshtrain generate --checkpoint runs/tiny --prompt "Four score" --max-new-tokens 40 --temperature 0

Every key of the YAML file can be overridden with a dotted flag. Bad input (a config
value, a dataset, a checkpoint) is printed as one line without a traceback and exits with
status 2, as argument errors do. A run stopped by its own safeguards (non-finite losses)
prints one line and exits 1. A rank that fails in a self-launched run is reported with its
own traceback, first, and the command exits 1 (3 for a rank the watchdog found stalled,
when it runs under torchrun).
"""

from __future__ import annotations

import sys

from .errors import ConfigError, TrainingError

EXIT_CONFIG = 2


# Errors come back to main() to be printed as one line (not usage + message), and a
# prefix of a key is an unknown key, not an abbreviation of it.
_STRICT = dict(exit_on_error=False, allow_abbrev=False)


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    from .config import RunConfig

    # A class_path in a config value must not import anything (a module's import runs its
    # code): the only class a config may name is the MoE section, which is ours.
    set_parsing_settings(docstring_parse_attribute_docstrings=True, import_path_denylist=["*"],
                         import_path_allowlist=["meshtrain.config.schema.MoeSection"])
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
                      help="Ranks to plan for (default: the product of the fixed parallel.* sizes, or one node).")
    plan.add_argument("--gpu", default=None, choices=["h100", "h200", "a100"],
                      help="Check the peak memory against this device's capacity.")
    plan.add_argument("--json", default=None, help="Also write the plan as JSON to this file.")
    plan.add_class_arguments(RunConfig, as_group=False)
    preprocess = ArgumentParser(**_STRICT, description="Tokenize a JSON-lines file into a Megatron-LM indexed dataset "
                                            "(<prefix>.bin and <prefix>.idx).")
    preprocess.add_argument("--input", required=True, help="A .jsonl file: one JSON object per line.")
    preprocess.add_argument("--output-prefix", required=True, help="Path of the output without .bin/.idx.")
    preprocess.add_argument("--tokenizer", default="bytes", help="bytes, or the path of a tokenizer.json.")
    preprocess.add_argument("--append-eod", action="store_true", help="End every document with EOS.")
    preprocess.add_argument("--workers", type=int, default=1, help="Processes that tokenize in parallel.")
    preprocess.add_argument("--text-key", default="text", help="The JSON key holding each document's text.")
    export = ArgumentParser(**_STRICT, description="Write a checkpoint as a Hugging Face model directory: safetensors "
                                        "(sharded with an index above --max-shard-gb), config.json, "
                                        "generation_config.json and the run's tokenizer files. Streams one "
                                        "tensor at a time.")
    export.add_argument("--checkpoint", required=True,
                        help="A checkpoint directory (<run_dir>/checkpoints/step_N) or a run directory (its latest).")
    export.add_argument("--out", required=True, help="The output directory (must not exist or be empty).")
    export.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                        help="Weight dtype of the export (default: the run's, as checkpoint.export writes: fp32 "
                             "for train.precision fp32, else bf16).")
    export.add_argument("--max-shard-gb", type=float, default=2.0, help="Split the weights into files this large.")
    generate = ArgumentParser(**_STRICT, description="Continue a prompt with a trained model (one process, KV cache).")
    generate.add_argument("--checkpoint", required=True,
                          help="A checkpoint directory, a run directory (its latest), or a Hugging Face model directory.")
    generate.add_argument("--prompt", default=None, help="Text, encoded with the run's tokenizer.")
    generate.add_argument("--prompt-ids", default=None, help="Token ids instead of --prompt, e.g. 1,2,3.")
    generate.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate at most.")
    generate.add_argument("--temperature", type=float, default=1.0, help="0: greedy.")
    generate.add_argument("--top-k", type=int, default=None, help="Sample among the k most likely tokens.")
    generate.add_argument("--top-p", type=float, default=None, help="Sample within this probability mass.")
    generate.add_argument("--seed", type=int, default=0, help="Seed of the sampler.")
    generate.add_argument("--output-format", default="text", choices=["text", "json"],
                          help="json: one object per line with prompt_ids, generated_ids and text.")
    generate.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available).")
    subcommands = parser.add_subcommands(dest="command")
    subcommands.add_subcommand("fit", fit, help="Train a model (one process, self-launched ranks, or under torchrun).")
    subcommands.add_subcommand("plan", plan, help="Dry-run a layout: sharding, memory and collectives per rank.")
    subcommands.add_subcommand("preprocess", preprocess, help="Tokenize text into a Megatron-LM indexed dataset.")
    subcommands.add_subcommand("export", export, help="Export a checkpoint to Hugging Face safetensors.")
    subcommands.add_subcommand("generate", generate, help="Generate text from a checkpoint or a Hugging Face model.")
    return parser


def _run_config(namespace):
    from .config import RunConfig

    values = namespace.as_dict()
    for key in ("config", "__path__", "__default_config__"):
        values.pop(key, None)
    return RunConfig.from_dict(values)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from argparse import ArgumentError

    from .data.errors import DataError
    from .launch import RankFailed
    from .train.checkpoint import CheckpointError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "fit":
            from .train.fit import fit

            fit(_run_config(args.fit))
        elif args.command == "plan":
            _plan(args.plan)
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
        return 0
    except ConfigError as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except ArgumentError as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"meshtrain: config error: {message.replace('Parser key ', 'key ')}", file=sys.stderr)
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


def _plan(a) -> None:
    import json
    import time

    from rich.console import Console

    from .parallel.dryrun import dry_run

    start = time.perf_counter()
    values = a.clone()
    for key in ("world", "gpu", "json"):
        delattr(values, key)
    run = dry_run(_run_config(values).validate(), a.world, a.gpu)
    console = Console(highlight=False)
    if not console.is_terminal:  # files and pipes: wide enough that no name is cut
        console = Console(highlight=False, width=160)
    for renderable in run.renderables():
        if not (isinstance(renderable, str) and renderable.startswith("[red]error")):
            console.print(renderable)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(run.to_dict(), f, indent=1)
    console.print(f"planned in {time.perf_counter() - start:.1f} s" + (f"; JSON in {a.json}" if a.json else ""))
    run.check()  # a layout over the GPU's memory: exit 2 after showing why


def _export(a) -> None:
    from .interop.hf import export_checkpoint

    if not a.max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb={a.max_shard_gb}: give a positive size in GB")
    summary = export_checkpoint(a.checkpoint, a.out, dtype=a.dtype, max_shard_bytes=int(a.max_shard_gb * 2**30))
    print(f"exported step {summary['step']} of {summary['checkpoint']} to {a.out} ({summary['dtype']}, "
          f"{len(summary['files'])} file(s), {summary['total_bytes'] / 2**20:,.1f} MiB)")


def _preprocess(a) -> None:
    from .data.preprocess import preprocess

    stats = preprocess(a.input, a.output_prefix, tokenizer=a.tokenizer, append_eod=a.append_eod,
                       workers=a.workers, text_key=a.text_key)
    print(f"wrote {stats['documents']:,} documents, {stats['tokens']:,} tokens ({stats['dtype']}) to "
          f"{a.output_prefix}.bin and {a.output_prefix}.idx, the tokenizer's record to {stats['record']}")


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
