# aqflow: calibrate -> quantize every linear (one job each) -> stitch an AQLM checkpoint -> evaluate
# -> PV-tune -> evaluate (and time decoding) -> report.
# Rules only wire: every computation is a `python -m aqflow <stage>` of the library in src/aqflow.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "workflow/rules/overrides.smk"


validated(config, "workflow/schemas/config.schema.yaml")


# the image every rule runs in with `--sdm apptainer` (built from docker/Dockerfile)
container: config["container"]


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/sequential.smk"
include: "workflow/rules/fetch.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/pvtune.smk"
include: "workflow/rules/speed.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/experiments.smk"


# every geometry of the targets and grid cells against its model's layer widths, before any job
PLAN.check_geometries()


rule all:
    default_target: True
    input:
        all_targets,
