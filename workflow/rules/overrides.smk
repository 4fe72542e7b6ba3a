# Your own settings layered over config.yaml and a profile, without replacing the profile's files:
#   snakemake --profile profiles/demo TARGET... --config overrides=my.yaml[,more.yaml]
# Precedence, lowest first: config.yaml < the profile's configfile list (or --configfile) <
# override files, in the order given < --config KEY=VALUE. Files are merged key by key (nested
# sections keep the keys they do not set); the result is validated against the schema after it.
# (`--configfile my.yaml` on the command line replaces the profile's configfile list instead.)
from pathlib import Path

from snakemake.common.configfile import load_configfile
from snakemake.utils import update_config


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
