# Your own settings layered over config.yaml and a profile, without replacing the profile's files:
#   snakemake --profile profiles/demo TARGET... --config overrides=my.yaml[,more.yaml]
# Precedence, lowest first: config.yaml < the profile's configfile list (or --configfile) <
# override files, in the order given < --config KEY=VALUE. Files are merged key by key (nested
# sections keep the keys they do not set); the result is validated against the schema after it.
# `--configfile my.yaml` next to such a profile would replace its configfile list (Snakemake's
# command line wins over a profile's values): refused, pointing at `--config overrides=my.yaml`.
import os
import sys
from pathlib import Path

import yaml
from snakemake.common.configfile import load_configfile
from snakemake.exceptions import WorkflowError
from snakemake.utils import update_config, validate


def profile_configfile_clash():
    """The one-line refusal of `--configfile` given on the command line next to a `--profile` whose
    config.yaml lists configfiles (they would be dropped, silently), or None. Read from the command
    line as Snakemake parses it, in the main process of the `snakemake` command only."""
    program = Path(sys.argv[0])
    if not workflow.is_main_process or "snakemake" not in (
        program.name,
        program.parent.name,
    ):
        return None
    from snakemake.cli import get_argument_parser, get_profile_dir

    try:
        given = get_argument_parser().parse_args(sys.argv[1:])  # no profile applied
    except SystemExit:
        return None
    if not given.configfile:
        return None
    for profile in given.profile or []:
        # a profile path is relative to where snakemake was started, which --directory changed:
        # the repository's profiles are found beside the Snakefile
        candidates = [
            Path(base, profile)
            for base in (os.environ.get("PWD", "."), workflow.basedir)
        ]
        started = next((path for path in candidates if path.exists()), None)
        found = get_profile_dir(str(started) if started is not None else profile)
        if found is None:
            continue
        listed = (yaml.safe_load(found[1].read_text()) or {}).get("configfile")
        if listed:
            mine = ",".join(str(path) for path in given.configfile)
            return (
                f"aqflow: --configfile {mine} would replace profile {profile}'s configfile list "
                f"({', '.join(map(str, listed))}) instead of layering over it; give it as "
                f"`--config overrides={mine}` (config.yaml < the profile's files < yours)"
            )
    return None


if profile_configfile_clash():
    raise SystemExit(profile_configfile_clash())


def override_files(value):
    """`overrides` as given: one path, comma-separated paths, or a YAML list of paths."""
    if value is None:
        return []
    paths = value.split(",") if isinstance(value, str) else list(value)
    return [str(path).strip() for path in paths if str(path).strip()]


OVERRIDE_FILES = override_files(config.pop("overrides", None))
for override in OVERRIDE_FILES:
    if not Path(override).is_file():
        raise ValueError(
            f"--config overrides: {override} does not exist (paths are relative to {Path.cwd()})"
        )
    update_config(config, load_configfile(override))
# --config KEY=VALUE stays topmost (the configfile directive applied it before the overrides)
update_config(
    config,
    {
        key: value
        for key, value in workflow.config_settings.config.items()
        if key != "overrides"
    },
)


# Keys that moved between sections: (old section, key, new section)
MOVED_KEYS = (
    ("evaluation", "cpu_kernel", "execution"),
    ("evaluation", "gpu_kernel", "execution"),
)


def validated(config, schema):
    """`validate` (the schema's defaults filled in), its error one line naming the key and the
    reason (not Snakemake's dump of the whole schema), with a hint when config.yaml, the base every
    other file is layered over, was not found (it is read from the working directory).
    """
    for section, key, home in MOVED_KEYS:
        if key in (config.get(section) or {}):
            raise SystemExit(
                f"aqflow: config: {section}.{key} is now {home}.{key} (how a job runs, not what it "
                f"computes: changing it reruns nothing); move it there in your config file"
            )
    try:
        validate(config, schema)
    except WorkflowError as error:
        cause = error.__cause__ or error.__context__  # jsonschema's ValidationError
        if not hasattr(cause, "absolute_path"):
            raise
        where = ".".join(str(part) for part in cause.absolute_path) or "the top level"
        base = ""
        if cause.validator == "required" and not Path("config.yaml").is_file():
            base = (
                "; config.yaml, the base the other files are layered over, is read from the "
                f"working directory ({Path.cwd()}) and is not there"
            )
        raise SystemExit(f"aqflow: config: {where}: {cause.message}{base}")
