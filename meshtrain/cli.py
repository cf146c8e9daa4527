"""The `meshtrain` command line.

    meshtrain fit --config configs/tiny.yaml [--train.steps 20 --parallel.tp 2 ...]
    meshtrain fit --config configs/tiny.yaml --print_config

Every key of the YAML file can be overridden with a dotted flag. Configuration errors
(meshtrain.errors.ConfigError) are printed without a traceback and exit with status 2,
as argument errors do.
"""

from __future__ import annotations

import sys

from .errors import ConfigError

EXIT_CONFIG = 2


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    from .config import RunConfig

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog="meshtrain", description="Megatron-class LLM pre-training in PyTorch.")
    fit = ArgumentParser(description="Train a model. Values come from the defaults, then --config files, "
                                     "then dotted flags, in the order given.")
    fit.add_argument("--config", action=ActionConfigFile, help="A YAML file with the keys below.")
    fit.add_class_arguments(RunConfig, as_group=False)
    subcommands = parser.add_subcommands(dest="command")
    subcommands.add_subcommand("fit", fit, help="Train a model (single process or under torchrun).")
    return parser


def _run_config(namespace):
    from .config import RunConfig

    values = namespace.as_dict()
    for key in ("config", "__path__", "__default_config__"):
        values.pop(key, None)
    return RunConfig.from_dict(values)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "fit":
            from .train.fit import fit

            fit(_run_config(args.fit))
        return 0
    except ConfigError as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
