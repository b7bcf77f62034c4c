"""The reference pages of the docs, generated from the code that defines them.

Three pages, each a markdown string built from one source of truth:

* ``configuration.md`` from the pydantic schema in ``kvtier.config`` (every key, its
  type, default, whether it is required, its ``KVTIER__...`` environment variable, and
  the ``#:`` comment above the field);
* ``metrics.md`` from ``kvtier.metrics.SERIES`` and the router's ``RouterMetrics``;
* ``cli.md`` from the argparse parsers of ``kvtier`` and ``kvtier router``.

``python -m kvtier.docgen --write docs/`` regenerates them; ``--check docs/`` exits 1,
naming each page that differs from what the code generates and the command to run.

Invariants:

* The output depends on the code only: never on the environment, the terminal width or
  the clock, so ``--check`` passes on every machine that has the same code.
* Every field of the schema, every series and every command-line flag appears in its
  page; a field, series or flag without its own help text still gets a row.
* Hand-written text here is limited to short page introductions and the descriptions of
  fields and flags that carry none in the code (``_FIELD_DOCS``, ``_FLAG_HELP``); each
  such entry must name something that exists (``stale_fallbacks``).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic.functional_validators import BeforeValidator

from kvtier import config as cfgmod
from kvtier import metrics

REGENERATE = "python -m kvtier.docgen --write docs/"
_HEADER = "<!-- Generated from {source} by `{cmd}`; do not edit by hand. -->\n\n"

#: Descriptions of schema fields that have no ``#:`` comment in ``kvtier/config.py``,
#: keyed by ``Model.field``.
_FIELD_DOCS: dict[str, str] = {
    "KVTierConfig.chunk_tokens": "Tokens per stored chunk (one object below the host "
    "tier). Must be a multiple of vLLM's block size; the connector refuses to start "
    "otherwise.",
    "KVTierConfig.copy_backend": "Gather/scatter implementation: `native` (the `kvtier._C` "
    "extension; an error if it is missing), `torch` (the reference), or `auto` (native "
    "when usable, else torch, the reason logged once).",
    "KVTierConfig.tiers": "The ordered tiers: `tiers[0]` is the host pool, then any number "
    "of `file` and `s3` tiers. Each list item has exactly one of `host`, `file`, `s3`.",
    "HostConfig.capacity": "Size of the host-memory pool. Under vLLM it is a file in "
    "`/dev/shm` (the `KVTIER_SHM_DIR` environment variable moves it), which must have room.",
    "HostConfig.pinned": "Page-lock the pool for CUDA copies: `yes` (fail at start if it "
    "cannot), `auto` (when possible), `no`.",
    "FileConfig.path": "Directory of the tier (local disk, NFS, CephFS). kvtier creates "
    "this directory but never its parents, so an unmounted share is an error.",
    "FileConfig.capacity": "Bytes the tier may hold (temp files of writes in flight count).",
    "FileConfig.write": "`back`: written when the host pool spills or flushes; `through`: "
    "written as soon as a chunk is stored (sharing between nodes and P/D need this).",
    "FileConfig.fsync": "fsync each object before it becomes visible.",
    "FileConfig.touch_interval": "Seconds: a read refreshes an object's recency and lease "
    "stamp (its mtime) at most this often. Must be below `retention.lease_seconds`.",
    "S3Config.bucket": "Bucket name.",
    "S3Config.prefix": "Key prefix of every object (e.g. `prod/`).",
    "S3Config.endpoint_url": "Any S3 endpoint, e.g. `http://minio:9000`; null for AWS.",
    "S3Config.region": "Region name; null leaves it to boto3's configuration.",
    "S3Config.path_style": "Path-style addressing (most self-hosted endpoints need it).",
    "S3Config.capacity": "Bytes the tier may hold.",
    "S3Config.write": "As `file.write`.",
    "S3Config.multipart_threshold": "Objects larger than this are uploaded in parts.",
    "S3Config.part_size": "Size of one multipart part.",
    "S3Config.max_concurrency": "Parallel parts and ranged GETs of one object.",
    "S3Config.connect_timeout": "Seconds to connect.",
    "S3Config.read_timeout": "Seconds per socket read.",
    "S3Config.touch_interval": "As `file.touch_interval` (the stamp is a self-copy).",
    "IOConfig.threads": "IO threads of each lower tier (every tier has its own).",
    "IOConfig.max_queued_stores": "Stores queued per lower tier; when full, a store is "
    "dropped and counted (`kvtier_drops_total`), never waited for.",
    "RestoreConfig.recompute_threshold_tokens": "Restore only when at least this many "
    "stored tokens can be reused, else recompute; `auto` decides per request from "
    "measured restore and prefill costs.",
    "RetentionConfig.lease_seconds": "Objects on shared tiers are kept at least this long "
    "after their last use; every read renews the lease. Expired objects are removed by "
    "the router's heartbeat or `kvtier gc --expired`.",
}

#: Help for command-line flags that have none in their parser, keyed by the first
#: option string (``"router --host"`` for the router's).
_FLAG_HELP: dict[str, str] = {
    "-v": "log at INFO level; goes before the subcommand (`kvtier -v check ...`)",
    "check CONFIG": "the kvtier YAML file",
    "ls CONFIG": "the kvtier YAML file",
    "stats CONFIG": "the kvtier YAML file",
    "gc CONFIG": "the kvtier YAML file",
    "router --host": "address the router listens on",
    "router --port": "port the router listens on",
    "router --request-timeout": "a backend call's limit: the whole call when not "
    "streamed, the gap between two chunks when streamed; then 504",
    "router --connect-timeout": "seconds to connect to a backend",
}


# -- configuration ----------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigKey:
    """One key of the YAML file, as the configuration page shows it."""

    path: str  # "restore.lookup_timeout_seconds", "tiers[i].file.path"
    env: str  # "KVTIER__RESTORE__LOOKUP_TIMEOUT_SECONDS"
    type: str
    default: str  # "" when required
    required: bool
    doc: str


@dataclass(frozen=True)
class ConfigSection:
    """One model of the schema: a heading, its docstring and its scalar keys."""

    title: str
    intro: str
    keys: tuple[ConfigKey, ...]


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """The ``#:`` comment lines right above each field of ``model``'s class body."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(model).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", stripped)
        if m and pending and m.group(1) in model.model_fields:
            out[m.group(1)] = " ".join(pending)
        pending = []
    return out


def _rst_to_md(text: str) -> str:
    return text.replace("``", "`")


def _validator_kind(info: FieldInfo) -> str | None:
    for meta in info.metadata:
        if isinstance(meta, BeforeValidator):
            if meta.func is getattr(cfgmod, "_size", None):
                return "size"
            if meta.func is getattr(cfgmod, "_file_mode", None):
                return "mode"
    return None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        choices = [f"`{a}`" for a in get_args(tp)]
        return choices[0] if len(choices) == 1 else "one of " + ", ".join(choices)
    if origin in (Union, types.UnionType):
        parts = [_type_name(a) for a in get_args(tp) if a is not type(None)]
        if type(None) in get_args(tp):
            parts.append("null")
        return " or ".join(parts)
    if origin is list:
        (item,) = get_args(tp)
        return "list of tiers" if item is cfgmod.TierEntry else f"list of {_type_name(item)}"
    if tp is Path:
        return "path"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


#: pydantic's constraint metadata -> (how the page writes it, the attribute it holds)
_BOUNDS: tuple[tuple[type[Any], str, str], ...] = (
    (annotated_types.Ge, ">= ", "ge"), (annotated_types.Gt, "> ", "gt"),
    (annotated_types.Le, "<= ", "le"), (annotated_types.Lt, "< ", "lt"),
    (annotated_types.MinLen, "length >= ", "min_length"),
    (annotated_types.MaxLen, "length <= ", "max_length"),
)


def _bounds(info: FieldInfo) -> str:
    marks = [f"{text}{_number(getattr(meta, attr))}" for meta in info.metadata
             for kind, text, attr in _BOUNDS if isinstance(meta, kind)]
    return ", ".join(marks)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def size_text(n: int) -> str:
    """A byte count as the YAML would write it: ``64MiB`` when exact, else bytes."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _default_text(value: Any, kind: str | None) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if kind == "size":
        return f"`{size_text(int(value))}`"
    if kind == "mode":
        return f'`"{int(value):04o}"`'
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{_number(value)}`"


def _key(model: type[BaseModel], name: str, info: FieldInfo, path: str, env: str,
         comments: dict[str, str]) -> ConfigKey:
    kind = _validator_kind(info)
    if kind == "size":
        tp = "size (`32GiB`, `512MiB`, bytes)"
    elif kind == "mode":
        tp = 'octal permission string (`"0640"`)'
    else:
        tp = _type_name(info.annotation)
    bounds = _bounds(info)
    if bounds:
        tp = f"{tp}, {bounds}"
    doc = comments.get(name) or _FIELD_DOCS.get(f"{model.__name__}.{name}", "")
    required = info.is_required()
    default = "" if required else _default_text(info.default, kind)
    return ConfigKey(path, env, tp, default, required, _rst_to_md(doc))


def _model_keys(model: type[BaseModel], path: str, env: str) -> tuple[ConfigKey, ...]:
    comments = field_comments(model)
    keys = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            continue  # its own section
        dotted = f"{path}.{name}" if path else name
        keys.append(_key(model, name, info, dotted, f"{env}__{name.upper()}", comments))
    return tuple(keys)


def _intro(model: type[BaseModel]) -> str:
    """The model's own docstring (not one it inherits), as markdown."""
    doc = vars(model).get("__doc__")
    return _rst_to_md(inspect.cleandoc(doc)) if isinstance(doc, str) else ""


def config_sections() -> list[ConfigSection]:
    """The schema, one section per model, in the order a YAML file would have them."""
    root = cfgmod.KVTierConfig
    prefix = cfgmod.ENV_PREFIX.rstrip("_")
    sections = [ConfigSection("Top level", "", _model_keys(root, "", prefix))]
    tier_models: tuple[tuple[str, type[BaseModel], str, str], ...] = (
        ("host", cfgmod.HostConfig, "0", "The host pool; always `tiers[0]`, and only there."),
        ("file", cfgmod.FileConfig, "i", "A directory: local disk, NFS or CephFS. `i` is "
         "the tier's position in the list (1, 2, ...)."),
        ("s3", cfgmod.S3Config, "i", "An S3 bucket (AWS, MinIO, Ceph RGW, any endpoint). "
         "Credentials come only from boto3's chain (environment, `~/.aws`, instance role)."),
    )
    for kind, model, idx, intro in tier_models:
        env_idx = "<i>" if idx == "i" else idx
        sections.append(ConfigSection(
            f"tiers[{idx}].{kind}", intro,
            _model_keys(model, f"tiers[{idx}].{kind}",
                        f"{prefix}__TIERS__{env_idx}__{kind.upper()}")))
    for name, info in root.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sections.append(ConfigSection(name, _intro(ann),
                                          _model_keys(ann, name, f"{prefix}__{name.upper()}")))
    return sections


def config_paths() -> list[str]:
    """Every key's dotted path (``tiers[i].file.path``), for tests and the page."""
    return [k.path for s in config_sections() for k in s.keys]


_CONFIG_INTRO = """\
# Configuration reference

kvtier reads one YAML file. Every key is validated when it loads: unknown keys are
errors, every error names the key's path (`tiers[1].s3.bucket: Field required`), all
errors are listed at once, and no error quotes a value (a secret typed in the wrong place
must not reach a log). Sizes are written like `32GiB`, `512MiB` or a byte count.

A minimal file:

```yaml
tiers:
  - host: {capacity: 8GiB}
  - file: {path: /var/cache/kvtier, capacity: 500GiB}
```

**Environment overrides.** Any key can be set by an environment variable named after its
path: `KVTIER__` then the path with `__` between parts, e.g.
`KVTIER__RESTORE__RECOMPUTE_THRESHOLD_TOKENS=32` or `KVTIER__TIERS__1__FILE__PATH=/x`.
The value is parsed as YAML. Tier keys are addressed by list position, so an override
retargets if the order of the tiers changes, and it can change an existing tier but not
add one. The vLLM connector's `overrides` (see [vLLM integration](vllm.md)) win over the
environment, and both win over the file.

**Tier names.** Metrics, logs and `kvtier` output name a tier `host`, `file<i>` or
`s3<i>`, where `i` is its position in `tiers`: the second item of the list, a file tier,
is `file1`.

**Removed keys.** `retention.renew_on_access` was removed (every read renews a lease);
a file that still sets it is refused with a message saying to delete it.

Relative paths (`file.path`, and the connector's `config`) resolve against the working
directory of the process that loads them. Shipped examples: `configs/local.yaml` (host
and a local directory), `configs/nfs.yaml`, `configs/s3.yaml`, `configs/pd-shared.yaml`.
"""


def _cell(text: str) -> str:
    """Markdown table cell: no line breaks, no bare pipes, no bare ``<``."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def config_page() -> str:
    """``docs/configuration.md``."""
    out = [_HEADER.format(source="kvtier/config.py", cmd=REGENERATE), _CONFIG_INTRO]
    for section in config_sections():
        out.append(f"\n## `{section.title}`\n" if section.title != "Top level"
                   else "\n## Top level\n")
        if section.intro:
            out.append(f"\n{section.intro}\n")
        out.append("\n| Key | Type | Default | Required | Environment variable | Description |"
                   "\n|---|---|---|---|---|---|\n")
        for k in section.keys:
            default, required = ("-", "**yes**") if k.required else (k.default, "no")
            out.append(f"| `{k.path}` | {_cell(k.type)} | {default} | {required} | `{k.env}` | "
                       f"{_cell(k.doc)} |\n")
    return "".join(out)


# -- metrics ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricRow:
    """One Prometheus series as the metrics page shows it."""

    name: str  # as exposed (counters end in _total)
    kind: str
    labels: tuple[str, ...]
    doc: str


def engine_metrics() -> list[MetricRow]:
    """kvtier's series on the vLLM API server's ``/metrics`` (``kvtier.metrics.SERIES``)."""
    return [MetricRow(s.name, s.kind.value, s.labels, s.doc) for s in metrics.SERIES.values()]


def router_metrics() -> list[MetricRow]:
    """The ``kvtier router``'s own series (a ``RouterMetrics`` registry, built unfed)."""
    from prometheus_client.metrics import MetricWrapperBase

    from kvtier.router.metrics import RouterMetrics

    rm = RouterMetrics(lambda: 0, lambda: 0, lambda: 0, lambda: 0.0)
    labels: dict[str, tuple[str, ...]] = {}
    for value in vars(rm).values():
        if isinstance(value, MetricWrapperBase):
            labels[str(getattr(value, "_name", ""))] = tuple(getattr(value, "_labelnames", ()))
    rows = []
    for family in rm.registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        rows.append(MetricRow(name, family.type, labels.get(family.name, ()),
                              family.documentation))
    return sorted(rows, key=lambda r: r.name)


def _metric_table(rows: Sequence[MetricRow]) -> Iterator[str]:
    yield "| Series | Type | Labels | Help |\n|---|---|---|---|\n"
    for r in rows:
        labels = ", ".join(f"`{label}`" for label in r.labels) or "-"
        yield f"| `{r.name}` | {r.kind} | {labels} | {_cell(r.doc)} |\n"


_METRICS_INTRO = """\
# Metrics reference

## Engine series

kvtier's series are on the vLLM API server's own `/metrics`, next to vLLM's, with
vLLM's labels (`model_name`, `engine`) in addition to those below. They travel through
vLLM's connector stats: the engine core and the workers hand each step's counts to vLLM,
which carries them to the API server, so keep stats on (do not pass
`--disable-log-stats`). A series appears once the engine has counted something for it:
a missing series means "nothing yet". An idle engine does not report, so counts from
background writes after the last request show up with the next request. vLLM's periodic
`KV Transfer metrics` log line prints the same counts.

The `tier` label is `host`, `file<i>` or `s3<i>` (`i`: the tier's position in `tiers`).
Histograms expose `_bucket`, `_sum` and `_count`.

"""


def metrics_page() -> str:
    """``docs/metrics.md``."""
    out = [_HEADER.format(source="kvtier/metrics.py and kvtier/router/metrics.py",
                          cmd=REGENERATE), _METRICS_INTRO]
    out.extend(_metric_table(engine_metrics()))
    stages = ", ".join(f"`{s}`" for s in metrics.RESTORE_STAGES)
    buckets = ", ".join(_number(b) for b in metrics.RESTORE_STAGE_SECONDS.buckets)
    out.append(f"\nRestore stages (`kvtier_restore_stage_seconds{{stage}}`): {stages}. "
               f"Histogram buckets of the `_seconds` series, in seconds: {buckets}.\n")
    out.append("\n## Router series\n\n`kvtier router` serves its own `/metrics` "
               "(no authentication, like vLLM's):\n\n")
    out.extend(_metric_table(router_metrics()))
    out.append("\nA Grafana dashboard for the engine series is in "
               "`configs/grafana-kvtier.json`; import it next to vLLM's own.\n")
    return "".join(out)


# -- command line -----------------------------------------------------------------------
@dataclass(frozen=True)
class FlagRow:
    """One argument of one command."""

    names: str
    default: str
    help: str


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flag_default(action: argparse.Action) -> str:
    if action.required:
        return "required" + (", repeatable" if isinstance(action, argparse._AppendAction)
                             else "")
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off"
    if action.default is None or action.default is argparse.SUPPRESS:
        return "-"
    return f"`{action.default}`"


def _first_name(action: argparse.Action) -> str:
    """``--host`` for an option, ``CONFIG`` for a positional: the key of ``_FLAG_HELP``."""
    if action.option_strings:
        return action.option_strings[0]
    return str(action.metavar or action.dest.upper())


def flag_rows(p: argparse.ArgumentParser, command: str = "") -> list[FlagRow]:
    """The arguments of ``p`` (positionals first), without help and subcommands."""
    rows = []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        names = _first_name(action)
        if action.option_strings:
            names = ", ".join(action.option_strings)
            if action.nargs != 0:
                names += f" {action.metavar or action.dest.upper()}"
        key = f"{command} {_first_name(action)}".strip()
        text = action.help or _FLAG_HELP.get(key, "")
        if action.choices and not isinstance(action.choices, dict):
            text = f"{text} (one of {', '.join(map(str, action.choices))})".strip()
        rows.append(FlagRow(names, _flag_default(action), text))
    return rows


def _usage(command: str, p: argparse.ArgumentParser) -> str:
    positional = [str(a.metavar or a.dest.upper()) for a in p._actions
                  if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    return " ".join(["kvtier", command, "[options]", *positional])


def _parser() -> argparse.ArgumentParser:
    from kvtier import cli

    return cli._parser()


_CLI_INTRO = """\
# Command line

The `kvtier` command is installed with the package; `python -m kvtier` is the same, and
`python -m kvtier.router ...` is `kvtier router ...`. Global options go before the
subcommand.

Exit codes: 0 success; 1 a check failed (a probe read back wrong data); 2 invalid usage
or config; 3 a resource is unusable (memory, directory, bucket).

`check` does real I/O: it allocates the host pool and writes, reads back and deletes
`--count` probe objects of `--chunk-size` bytes on every tier (S3 included), then prints
each tier's bandwidth and which conditional requests each S3 endpoint honours. `ls`,
`stats` and `gc` open the persistent tiers (`tiers[1:]`) and wait for their index.

"""


def cli_page() -> str:
    """``docs/cli.md``."""
    root = _parser()
    out = [_HEADER.format(source="kvtier/cli.py and kvtier/router/__init__.py",
                          cmd=REGENERATE), _CLI_INTRO]
    out.append("## Global options\n\n| Argument | Default | Description |\n|---|---|---|\n")
    out.extend(f"| `{r.names}` | {r.default} | {_cell(r.help)} |\n" for r in flag_rows(root))
    helps = {choice.dest: choice.help for action in root._actions
             if isinstance(action, argparse._SubParsersAction)
             for choice in action._choices_actions}
    for name, sub in _subparsers(root).items():
        summary = helps.get(name) or ""
        out.append(f"\n## `kvtier {name}`\n\n{_cell(summary[:1].upper() + summary[1:])}.\n\n"
                   f"```\n{_usage(name, sub)}\n```\n\n")
        out.append("| Argument | Default | Description |\n|---|---|---|\n")
        out.extend(f"| `{r.names}` | {r.default} | {_cell(r.help)} |\n"
                   for r in flag_rows(sub, name))
    return "".join(out)


# -- the pages --------------------------------------------------------------------------
PAGES: dict[str, Callable[[], str]] = {
    "configuration.md": config_page,
    "metrics.md": metrics_page,
    "cli.md": cli_page,
}


def stale_fallbacks() -> list[str]:
    """Entries of ``_FIELD_DOCS``/``_FLAG_HELP`` naming no field or flag, or shadowed by
    help the code now has (they would silently lie or go unused)."""
    out = []
    models = {m.__name__: m for m in (cfgmod.KVTierConfig, cfgmod.HostConfig,
                                      cfgmod.FileConfig, cfgmod.S3Config, cfgmod.IOConfig,
                                      cfgmod.HealthConfig, cfgmod.RestoreConfig,
                                      cfgmod.RetentionConfig, cfgmod.EventsConfig)}
    for entry in _FIELD_DOCS:
        model_name, field = entry.split(".")
        model = models.get(model_name)
        if model is None or field not in model.model_fields \
                or field in field_comments(model):
            out.append(entry)
    root = _parser()
    actions = {f"{cmd} {_first_name(a)}".strip(): a
               for cmd, p in [("", root), *_subparsers(root).items()] for a in p._actions}
    for entry in _FLAG_HELP:
        action = actions.get(entry)
        if action is None or action.help:
            out.append(entry)
    return out


def render(directory: Path) -> dict[Path, str]:
    """Each generated page's path under ``directory`` and its text."""
    return {directory / name: build() for name, build in PAGES.items()}


def drifted(directory: Path) -> list[Path]:
    """The generated pages under ``directory`` that are missing or differ from the code."""
    return [path for path, text in render(directory).items()
            if not path.is_file() or path.read_text(encoding="utf-8") != text]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvtier.docgen --write DIR`` or ``--check DIR``; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m kvtier.docgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="DIR", help="(re)write the pages in DIR")
    mode.add_argument("--check", type=Path, metavar="DIR",
                      help="exit 1 if a page in DIR differs from what the code generates")
    args = p.parse_args(argv)
    if args.write is not None:
        for path, text in render(args.write).items():
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        return 0
    stale = drifted(args.check)
    for path in stale:
        print(f"{path} is out of date with the code; regenerate it with: "
              f"python -m kvtier.docgen --write {args.check}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
