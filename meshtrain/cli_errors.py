"""The command line's argument errors as one line a user can act on: jsonargparse's and
argparse's messages turned into the key, what it takes and the fix — the nearest known
key, command or choice for a typo, the section's keys for a value given to a section, and
--config for a bare config file."""

from __future__ import annotations

_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
          "NoneType": "null"}


def explain(error, argv: list[str], parser) -> str:
    """jsonargparse's message as one line a user can act on: the key, what it takes, and
    the nearest known key or command for a typo."""
    import re

    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    message = message.replace("Parser key ", "key ")
    command = next((a for a in argv if not a.startswith("-")), None)
    choice = re.search(r"argument ([^:]+): invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        name, value = choice.group(1, 2)
        options = [c.strip(" '") for c in choice.group(3).split(",")]
        if name == "command":  # the subcommand's dest; any other name is an option's value
            return f"unknown command {value!r}{_nearest(value, options)}; commands: {', '.join(options)}"
        return f"{name.split('/')[0]} {value!r}: choose from {', '.join(options)}{_nearest(value, options)}"
    unknown = re.search(r"does not accept option '([^']*)'|unrecognized arguments: (\S+)", message)
    if unknown:
        if unknown.group(2) and not unknown.group(2).startswith("-"):  # a bare word, not an option
            return _bare_argument(unknown.group(2), command)
        name = (unknown.group(1) or unknown.group(2)).lstrip("-").split("=")[0]
        return (f"unknown key {name!r}{_nearest(name, _known_keys(parser, command))}; meshtrain {command} --help "
                "lists the keys")
    section = re.match(r"key \"([\w.]+)\": Unable to load config (['\"])(.*?)\2 - key \"\1\"", message) or \
        re.match(r"key \"(model\.moe)\": Does not validate .*Given value type: <class '(str|int|float|list)'> "
                 r"Given value: ()(.*)$", message)
    if section:
        return _section_value(section.group(1), section.group(3) or section.group(4), argv)
    union = re.match(r"key \"([\w.]+)\": Does not validate against any of the Union subtypes Subtypes: \[(.*?)\] "
                     r"Errors: .* Given value: (.*)$", message)
    if union and "NestedArg" not in message:
        kinds = [re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", k.strip()) for k in union.group(2).split(", ")]
        words = [_TYPES.get(k, {"dict": "a mapping", "list[int]": "a list of integers"}.get(k, k)) for k in kinds]
        return f"{union.group(1)}={union.group(3)!r}: expected {' or '.join(words)}"
    nested = re.search(r"key \"([\w.]+)\": Does not validate.*?key \"([\w.]+)\": Expected a <class '(\w+)'>\. "
                       r"Got value: (.*?)(?: - |$)", message)
    simple = re.fullmatch(r"key \"([\w.]+)\": Expected a <class '(\w+)'>\. Got value: (.*)", message)
    if nested or simple:
        key, kind, value = (f"{nested.group(1)}.{nested.group(2)}", *nested.group(3, 4)) if nested else simple.groups()
        return f"{key}={value!r}: expected {_TYPES.get(kind, kind)}"
    return message


def _bare_argument(word: str, command: str | None) -> str:
    """A word without an option before it: a config file given without --config, or a
    value whose key is missing."""
    import os

    if command in ("fit", "plan") and (os.path.isfile(word) or word.endswith((".yaml", ".yml"))):
        return f"unexpected argument {word!r} (did you mean --config {word}?)"
    return (f"unexpected argument {word!r}: values follow their key (--KEY VALUE); meshtrain {command} --help "
            "lists the keys")


# A section given a value instead of keys: the key the value most likely meant, by
# section (and, for some, by what the value looks like), with what that key does.
def _section_hint(section: str, value: str) -> tuple[str, str] | None:
    import os

    if section == "checkpoint":
        return "checkpoint.resume DIR", "resume from a checkpoint directory"
    if section == "data":
        return "data.paths PREFIX", "train on a dataset written by meshtrain preprocess"
    if section == "model":
        from .models import FAMILIES

        if value in FAMILIES:
            return f"model.arch {value}", "choose the model family"
        if os.path.isdir(value):
            return "model.init_from DIR", "start from a Hugging Face model directory"
    if section == "train" and value.isdigit():
        return f"train.steps {value}", f"run {value} optimizer steps"
    if section == "parallel" and value.isdigit():
        return f"parallel.nproc_per_node {value}", f"start {value} ranks on this node"
    if section == "model.moe":
        return "model.moe.num_experts N", "give each MoE block N experts"
    return None


def _section_value(section: str, value: str, argv: list[str]) -> str:
    """One line for `--checkpoint runs/x` (or `checkpoint: runs/x` in a YAML file): the key
    is a section, whose keys are named, with the nearest dotted key for the value."""
    import dataclasses

    from .config.schema import SECTIONS

    if section == "model.moe":
        from .models.moe import MoeConfig

        cls = MoeConfig
    elif section in SECTIONS:
        cls = SECTIONS[section]
    else:
        return f"{section}={value!r}: {section} is a section: give its keys ({section}.KEY VALUE)"
    keys = ", ".join(f.name for f in dataclasses.fields(cls))
    flag = any(a == f"--{section}" or a.startswith(f"--{section}=") for a in argv)
    hint = _section_hint(section, value)
    if hint is None:
        fix = f"give its keys as --{section}.KEY VALUE" if flag else f"give its keys nested under {section}"
    elif flag:
        fix = f"to {hint[1]}, use --{hint[0]}"
    else:  # the YAML of the dotted key, e.g. checkpoint: {resume: DIR}
        key, arg = hint[0].split(" ", 1)
        *outer, last = key.split(".")
        yaml = f"{last}: {arg}"
        for part in reversed(outer):
            yaml = f"{part}: {{{yaml}}}"
        fix = f"to {hint[1]}, write {yaml}"
    return f"{section} is a section, not a value ({value!r}): {fix}; {section} has {keys}"


def _nearest(name: str, known: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _known_keys(parser, command: str | None) -> list[str]:
    """The dotted keys a command takes: the RunConfig's fields (MoE's included) for fit and
    plan, and the command's own options."""
    import dataclasses

    from .config import RunConfig
    from .models.moe import MoeConfig

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            inner = MoeConfig if f.name == "moe" else f.default_factory if dataclasses.is_dataclass(
                f.default_factory) else None
            yield from walk(inner, f"{prefix}{f.name}.") if inner else [prefix + f.name]

    keys = list(walk(RunConfig, "")) if command in ("fit", "plan") else []
    commands = parser._subcommands_action._name_parser_map if parser is not None else {}
    if command in commands:
        keys += [o.lstrip("-") for a in commands[command]._actions for o in a.option_strings if o.startswith("--")]
    return keys
