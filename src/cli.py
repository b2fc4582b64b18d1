"""The command line: flags and `--config` YAML files -> a resolved TrainConfig (jsonargparse parses and type-checks).
The task is found first; its `Options` (src/tasks/) join the parser as flags and YAML keys (`--task X --help`)."""

import dataclasses
import difflib
import inspect
import itertools
import re
import sys
from pathlib import Path

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from src.config import TrainConfig, field_help
from src.errors import UsageError, one_line, show_tracebacks
from src.features import option_classes, options_of
from src.run_dir import CHECKPOINTS_DIR, CONFIG_FILE, MODEL_DIR, STATE_FILE
from src.tasks import BUILT_IN, parse_task_options, task_class, task_name

# What eval-only or predict takes from the evaluated run unless told: the model (task, options), its eval data and how
FROM_THE_RUN = ("task", "dataset_name", "dataset_config_name", "data_files", "train_split", "eval_split", "test_split")
FROM_THE_RUN += ("id_column", "max_eval_samples", "max_predict_samples", "per_device_eval_batch_size", "metrics")
FROM_THE_RUN += ("mixed_precision", "seed")


def parse_config(argv: "list[str] | TrainConfig | None") -> TrainConfig:
    """Defaults <- --config YAML <- flags, type-checked, else UsageError; argv None: sys.argv; TrainConfig: resolved."""
    if isinstance(argv, TrainConfig):
        show_tracebacks(argv.debug)
        return resolve(argv)
    argv = configs_first(sys.argv[1:] if argv is None else argv)
    show_tracebacks(str(setting(argv, "debug")).lower() in ("true", "yes", "1"))  # before anything can fail
    check_config_files(argv)
    run, run_config = run_to_evaluate(argv)
    name = find_task_name(argv, default=run_config.get("task", TrainConfig.task))
    cls = task_class(name)
    parser = build_parser(name, cls)
    option_names = [f.name for f in dataclasses.fields(cls.Options)]
    if run is not None:  # eval-only or predict from a run: what it does not say, the run's config.yaml says
        keys = {*FROM_THE_RUN, *(option_names if run_config.get("task") == name else ())}
        parser.set_defaults({"output_dir": str(run), **{k: v for k, v in run_config.items() if k in keys}})
    try:
        values = parser.parse_args(argv).as_dict()
    except Exception as err:  # jsonargparse reports every parse problem as some exception with a message
        message = one_line(err)
        said = readable(message)  # a known flag's value of the wrong type, in words: no other flag to name
        hint = suggestion(err, parser, cls, name, typed=said != message)
        raise UsageError(f"{said}{hint}; see `python train.py --task {name} --help`") from err
    values.pop("config", None)
    task_args = {k: values.pop(k) for k in option_names}
    feature_args = {f.name: values.pop(f.name) for options in option_classes() for f in dataclasses.fields(options)}
    return own_run_model(argv, resolve(TrainConfig(**values, task_args=task_args, feature_args=feature_args)))


def configs_first(argv: list[str]) -> list[str]:
    """The `--config` files ahead of the flags, in their order: jsonargparse applies each where it stands, so a flag
    before a file (`--do_train false --config run/config.yaml`) would lose to the file's value."""
    files, flags, args = [], [], iter(argv)
    for arg in args:
        if arg == "--config" and (value := next(args, None)) is not None:
            files += [arg, value]
        elif arg.startswith("--config="):
            files.append(arg)
        else:  # a flag, its value, or a last --config without one: the parser says so
            flags.append(arg)
    return [*files, *flags]


def flag_values(argv: list[str], name: str) -> list[str]:
    values = []
    for arg, following in itertools.pairwise([*argv, None]):
        if arg == f"--{name}" and following is not None:
            values.append(following)
        elif arg.startswith(f"--{name}="):
            values.append(arg.split("=", 1)[1])
    return values


def given(argv: list[str], name: str, default=None):
    """The last `--name X` / `--name=X` on the command line, else `default`."""
    return next(reversed(flag_values(argv, name)), default)


def yaml_mapping(path: Path) -> dict | None:
    """The YAML mapping the file holds; None for a missing file, bad YAML or another value (the parser reports them)."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def config_files(argv: list[str]) -> list[tuple[Path, dict]]:
    return [(Path(v), loaded) for v in flag_values(argv, "config") if (loaded := yaml_mapping(Path(v))) is not None]


def check_config_files(argv: list[str]) -> None:
    """A --config file holding no options (empty, a list) or an accelerate config: one line saying so. A missing file or
    bad YAML: the parser's line."""
    for value in flag_values(argv, "config"):
        try:
            loaded = yaml.safe_load(Path(value).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(loaded, dict):
            held = "nothing" if loaded is None else f"a {type(loaded).__name__}"
            raise UsageError(f"--config {value} holds {held}, not options: write one `name: value` a line")
        if "compute_environment" in loaded:  # every accelerate config has it
            raise UsageError(f"--config {value} is an accelerate config: `accelerate launch --config_file {value} "
                             "train.py` takes it")  # fmt: skip


def setting(argv: list[str], name: str):
    """`--name` on the command line, else the last `--config` file's `name`, else None."""
    in_files = [loaded[name] for _, loaded in config_files(argv) if name in loaded]
    return given(argv, name, default=in_files[-1] if in_files else None)


def run_to_evaluate(argv: list[str]) -> tuple[Path | None, dict]:
    """(run, its config.yaml) whose model eval-only or predict evaluates: --model_name_or_path's, --output_dir's or
    the task's default folder's (runs/digits)."""
    model = (
        setting(argv, "model_name_or_path") or setting(argv, "output_dir") or default_output_dir(find_task_name(argv))
    )
    if str(setting(argv, "do_train")).lower() not in ("false", "0", "no") or not isinstance(model, str) or not model:
        return None, {}  # not a path (e.g. a number in YAML): the parser says so
    path = Path(model)
    if (path / STATE_FILE).is_file() and (path / CONFIG_FILE).is_file():  # a checkpoint, with its run's config
        run, config_file = path.parent.parent, path / CONFIG_FILE
    else:  # the run's model/, or the run
        run = path.parent if path.name == MODEL_DIR and (path.parent / CONFIG_FILE).is_file() else path
        config_file = run / CONFIG_FILE
    loaded = yaml_mapping(config_file)
    return (None, {}) if loaded is None else (run, loaded)


def own_run_model(argv: list[str], config: TrainConfig) -> TrainConfig:
    """`--config <run>/config.yaml --do_train false` evaluates the run's model/, not the model it started from."""
    runs = [path.parent for path, _ in config_files(argv) if path.name == CONFIG_FILE]
    if config.do_train or given(argv, "model_name_or_path") or not runs:
        return config
    run = runs[-1]
    if (run / MODEL_DIR).is_dir():
        return dataclasses.replace(config, model_name_or_path=str(run / MODEL_DIR))
    if (run / CHECKPOINTS_DIR).is_dir():
        raise UsageError(
            f"--config {run / CONFIG_FILE} is the config of the run {run}, which has no {MODEL_DIR}/ yet; evaluate one "
            f"of its checkpoints with --model_name_or_path {run / CHECKPOINTS_DIR}/step_<N>"
        )
    return config  # a config.yaml of one's own, not a run's


def build_parser(name: str, task_cls):
    parser = ArgumentParser(
        description="Train a model with Hugging Face Accelerate.", exit_on_error=False, allow_abbrev=False
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the fields below")
    owner, helps = {}, {}  # flag -> whose field it is, and its help
    for options in [TrainConfig, *option_classes(), task_cls.Options]:  # the run's fields, the features', the task's
        names = [f.name for f in dataclasses.fields(options)]
        if clash := sorted(name for name in names if name in owner):
            owners = ", ".join(f"{name} ({owner[name]})" for name in clash)
            raise UsageError(f"{options.__qualname__} fields clash with fields of the same name: {owners}; rename them")
        owner |= dict.fromkeys(names, options.__qualname__)
        helps |= field_help(options)
        parser.add_class_arguments(options, as_group=options is task_cls.Options, skip={"task_args", "feature_args"})
    for action in parser._actions:  # jsonargparse takes help from docstrings; ours are the fields' comments
        action.help = helps.get(action.dest, action.help)
    source = Path(inspect.getsourcefile(task_cls) or "?").resolve()
    source = source.relative_to(Path.cwd()) if source.is_relative_to(Path.cwd()) else source
    group = parser.groups[task_cls.Options.__name__]
    group.title, group.description = f"options of --task {name} ({source}: {task_cls.__qualname__}.Options)", None
    return parser


def find_task_name(argv: list[str], default: str = TrainConfig.task) -> str:
    """`--task X` on the command line, else the last `--config` file's task, else `default` (digits, or the run's)."""
    name = setting(argv, "task")
    return name if isinstance(name, str) else default


KINDS = {"<class 'str'>": "text (in YAML, quoted)",
         "<class 'int'>": "a whole number", "<class 'float'>": "a number", "<class 'bool'>": "true or false",
         "<class 'list'>": "a list, written [a, b]", "<class 'NoneType'>": "null"}  # fmt: skip
TYPE_ERROR = re.compile(r'Parser key "(\w+)": Expected a (.+?)\. Got value: ?(.*)$')
UNION_ERROR = re.compile(r'Parser key "(\w+)": Does not validate .* Errors: (.*) Given value type: .* value: (.*)$')


def readable(message: str) -> str:
    """jsonargparse's wrong-type message in words (`--max_steps must be a whole number (got abc)`); others unchanged."""
    if found := re.match(r'Parser key "data_files": .* Given value: (.*)$', message):
        return f"--data_files {found.group(1)} is not a mapping of splits to files"
    if found := TYPE_ERROR.match(message):
        key, expected, value = found.groups()
        kinds = [expected]
    elif found := UNION_ERROR.match(message):  # an Optional: the type's error, then None's
        key, errors, value = found.groups()
        kinds = re.findall(r"- Expected a (.+?)(?= - Expected a |$)", errors)
    else:
        return message
    words = [in_words(kind) for kind in kinds]  # a kind without words (a list, a path): jsonargparse's message is best
    return message if None in words else f"--{key} must be {' or '.join(words)} (got {value or 'nothing'})"


def in_words(kind: str) -> str | None:
    """`<class 'int'>` -> a whole number, `typing.Literal['a', 'b']` -> one of a, b; None for other kinds."""
    if kind.startswith("typing.Literal"):
        return "one of " + ", ".join(re.findall(r"'([^']*)'", kind))
    return KINDS.get(kind)


def suggestion(err: Exception, parser, task_cls, name: str, typed: bool) -> str:
    """The hint: --data_files' form; unless `typed` (a known flag), the task owning the unknown key or a close flag."""
    if 'Parser key "data_files"' in str(err):  # most often a colon without its space: YAML reads one string
        return "; write it as a YAML mapping with a space after each colon: '{train: a.parquet, eval: b.parquet}'"
    if typed:
        return ""
    known = {a.dest for a in parser._actions}
    words = re.findall(r"--(\w+)|'(\w+)'", str(err))  # flags and quoted keys, in the message's order
    unknown = [w for pair in words for w in pair if w and w not in known]
    for word in unknown:
        for other_name in BUILT_IN:
            other = task_class(other_name)
            if other is not task_cls and word in {f.name for f in dataclasses.fields(other.Options)}:
                return f"; --{word} is an option of --task {other_name}, not of --task {name}"
        if close := difflib.get_close_matches(word, known, n=1):
            return f"; did you mean --{close[0]}?"
    return ""


def resolve(config: TrainConfig) -> TrainConfig:
    """Fill in what follows from the task: its options' defaults, its default data files, output_dir runs/<task>."""
    cls = task_class(config.task)
    options = dataclasses.asdict(parse_task_options(cls, config.task_args))
    feature_args = resolve_feature_args(config.feature_args)
    # neither given: the task's default files (none: a task whose data is its own; src/data.py says so if it reads)
    data_files = config.data_files if config.dataset_name or config.data_files else cls.default_data_files
    output_dir = config.output_dir or default_output_dir(config.task)
    model = config.model_name_or_path or (None if config.do_train else f"{output_dir}/model")  # the run's own model
    resolved = {"data_files": data_files, "output_dir": output_dir, "model_name_or_path": model}
    return dataclasses.replace(config, task_args=options, feature_args=feature_args, **resolved)


def default_output_dir(task: str) -> str:
    return f"runs/{task_name(task)}"


def resolve_feature_args(given: dict) -> dict:
    """Every installed feature's options, defaults filled in and checked by its Options; unknown names are refused."""
    classes = option_classes()
    if unknown := set(given) - {f.name for options in classes for f in dataclasses.fields(options)}:
        raise UsageError(f"unknown feature options {', '.join(sorted(unknown))}: no installed feature has them")
    return {k: v for options in classes for k, v in dataclasses.asdict(options_of(options, given)).items()}
